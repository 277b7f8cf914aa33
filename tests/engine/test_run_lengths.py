"""How many steps a fast-forwarded run plans (`Instance._steps_to_plan`) decides only
when the next run is planned, never what happens: an open-loop load whose arrivals cut
runs every few steps plans short runs (planning costs in proportion to the steps
planned), a closed loop of few requests keeps planning long ones."""

import pandas as pd
import pytest

from support import small_agentx
from labkit import Engine
from labkit.engine import instance
from labkit.traces import generate_random_trace


def _open_loop(engine):
    trace = generate_random_trace(num_prompts=300, request_rate=40.0, input_len=300,
                                  output_len=120, range_ratio=0.5, seed=2, block_size=16)
    return engine.replay(trace, open_loop=True)


def _closed_loop(engine):
    return engine.replay(small_agentx(6, seed=3), concurrency=4, duration_s=40)


LOADS = {"open loop, dp2": (_open_loop, dict(model="tiny-llama", layout="dp2")),
         "closed loop, spec decode": (_closed_loop, dict(model="tiny-llama", layout="tp1",
                                                         num_speculative_tokens=2,
                                                         acceptance_length=2.5))}


@pytest.mark.parametrize("name", list(LOADS))
def test_the_steps_a_run_plans_change_nothing(name, monkeypatch):
    load, knobs = LOADS[name]
    usual = load(Engine(hardware="h100", block_size=16, **knobs))
    # runs of at most 3 to 8 steps, whatever the load
    monkeypatch.setattr(instance, "MAX_RUN_STEPS", 8)
    monkeypatch.setattr(instance, "MIN_PLANNED_STEPS", 3)
    monkeypatch.setattr(instance, "PLANNED_CELLS", 1)
    short = load(Engine(hardware="h100", block_size=16, **knobs))
    pd.testing.assert_frame_equal(usual.requests, short.requests, check_exact=True)
    pd.testing.assert_frame_equal(usual.steps, short.steps, check_exact=True)
    drop = {"wall_s", "sim_speed"}
    assert {k: v for k, v in usual.summary.items() if k not in drop} == \
        {k: v for k, v in short.summary.items() if k not in drop}


def test_runs_cut_every_few_steps_plan_fewer(monkeypatch):
    planned = []
    plan = instance.Instance._steps_to_plan

    def recorded(self):
        planned.append(plan(self))
        return planned[-1]

    monkeypatch.setattr(instance.Instance, "_steps_to_plan", recorded)
    monkeypatch.setattr(instance, "PLANNED_CELLS", 64)  # (tiny-llama's batches are small)
    load, knobs = LOADS["open loop, dp2"]
    load(Engine(hardware="h100", block_size=16, **knobs))
    assert planned[0] == instance.MAX_RUN_STEPS  # nothing cut yet
    assert min(planned) == instance.MIN_PLANNED_STEPS
    assert sum(p < instance.MAX_RUN_STEPS for p in planned) > len(planned) / 2
    # a few requests (here 3-8 a rank): planning hundreds of steps costs little, so
    # runs stay long however soon arrivals cut them
    planned.clear()
    monkeypatch.setattr(instance, "PLANNED_CELLS", 4096)
    load(Engine(hardware="h100", block_size=16, **knobs))
    assert min(planned) >= 4096 // 8 and max(planned) == instance.MAX_RUN_STEPS
