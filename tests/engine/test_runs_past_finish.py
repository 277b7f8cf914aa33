"""Runs that go on past a finish: a fast-forwarded run of decodes does not end at the
step that finishes a request; the request leaves the run there (its blocks freed, its
finish announced at that step's end) and the others decode on (`decode_run.py`). The
replays must stay identical, bit for bit, to stepping one by one, in closed and open
loops, with and without prefix caching, offload tiers, spec decode, lockstep ranks
and synchronous scheduling; and the runs must indeed go on past finishes."""

import numpy as np
import pandas as pd
import pytest

from support import small_agentx
from labkit import Engine, Trace, TraceRequest
from labkit.engine import instance as instance_module
from labkit.engine.events import RequestTokens

CONFIGS = {
    "spec decode": dict(model="tiny-llama", layout="tp1", num_speculative_tokens=3,
                        acceptance_length=2.99),
    "no prefix caching": dict(model="tiny-llama", layout="dp2", enable_prefix_caching=False),
    "offload tiers, tight KV": dict(model="llama-3.1-8b", layout="tp1",
                                    num_gpu_blocks_override=1300, cpu_kv_gib=16),
    "dep4 lockstep": dict(model="tiny-qwen3-moe", layout="dep4", num_speculative_tokens=2,
                          acceptance_length=2.5, router="least_loaded"),
    "sync scheduling, dp3 round-robin": dict(model="tiny-llama", layout="dp3",
                                             router="round_robin", async_scheduling=False),
}


def open_loop_trace(n: int = 40, seed: int = 0) -> Trace:
    """Calls arriving at random times, with prompts sharing prefixes and outputs of
    varied lengths (so that requests finish in the middle of one another's runs)."""
    rng = np.random.default_rng(seed)
    calls = []
    for i in range(n):
        blocks = int(rng.integers(4, 40))
        shared = int(rng.integers(0, blocks))
        ids = np.concatenate([np.arange(shared), 10_000 * (i + 1) + np.arange(blocks - shared)])
        calls.append(TraceRequest(f"s{i}", f"r{i}", None, "main", 0.0, blocks * 16,
                                  int(rng.integers(5, 300)), ids.astype(np.int64),
                                  timestamp=float(rng.uniform(0.0, 3.0))))
    return Trace(16, sorted(calls, key=lambda c: c.timestamp))


def replay(ff: bool, cfg: dict, open_loop: bool = False):
    engine = Engine(hardware="h100", block_size=16, sim_fast_forward=ff, **cfg)
    tokens = []

    def per_step(e):  # a run reports many steps at once: one row per step
        for j, step in enumerate(e.step_index.tolist()):
            tokens.append((e.instance, step, tuple(e.request_ids), tuple(e.ranks.tolist()),
                           tuple(e.context[j].tolist()), tuple(e.num_new[j].tolist()),
                           tuple(e.decode[j].tolist()), tuple(e.held[j].tolist())))

    engine.events.subscribe(per_step, RequestTokens)
    if open_loop:
        result = engine.replay(open_loop_trace(), open_loop=True)
    else:
        result = engine.replay(small_agentx(6, seed=3), concurrency=4, duration_s=60,
                               max_idle_s=2.0, start_part_way=True)
    return result, tokens


def assert_same(fast, slow):
    pd.testing.assert_frame_equal(fast.requests, slow.requests, check_exact=True)
    pd.testing.assert_frame_equal(fast.steps, slow.steps, check_exact=True)
    drop = {"wall_s", "sim_speed"}
    assert {k: v for k, v in fast.summary.items() if k not in drop} == \
        {k: v for k, v in slow.summary.items() if k not in drop}


@pytest.mark.parametrize("open_loop", [False, True], ids=["closed loop", "open loop"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_runs_past_finishes_are_exact(name, open_loop, monkeypatch):
    went_on = count_runs_going_on(monkeypatch)
    (fast, fast_tokens), (slow, slow_tokens) = (replay(ff, CONFIGS[name], open_loop)
                                                for ff in (True, False))
    assert slow.summary["requests_completed"] > 10
    assert_same(fast, slow)
    # the per-step token columns too: a finished request leaves the later steps
    assert sorted(fast_tokens) == sorted(slow_tokens)
    assert went_on[0] > 0  # the configuration did exercise runs past finishes


def count_runs_going_on(monkeypatch) -> list:
    """Counts the commits of a run that finished requests and left the run in place."""
    counter = [0]
    commit = instance_module.Instance.commit

    def counting(self, plan):
        finished = commit(self, plan)
        counter[0] += bool(finished) and self.plan is plan
        return finished

    monkeypatch.setattr(instance_module.Instance, "commit", counting)
    return counter


def test_runs_go_on_past_finishes(monkeypatch):
    """The point of it: fewer runs planned for the same steps than when every finish
    ends its run."""
    planned = {}
    plan_run = instance_module.plan_decode_run
    for past in (True, False):
        calls = []

        def counting(*args, **kwargs):
            run = plan_run(*args, **kwargs)
            calls.append(run is not None)
            return run

        monkeypatch.setattr(instance_module, "plan_decode_run", counting)
        monkeypatch.setattr(instance_module.Instance, "_runs_past_finish", lambda self: past)
        result, _ = replay(True, CONFIGS["spec decode"])
        planned[past] = (sum(calls), len(result.steps))
    assert planned[True][1] == planned[False][1]  # the same steps...
    assert planned[True][0] < planned[False][0] - 10  # ...in fewer runs (192 vs 213)
