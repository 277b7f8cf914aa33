"""A run goes on through the landing of a call's prefix KV (`run_plan._join_landing`):
the call, on the wire while the others decode, joins the run at the step that takes
its KV in and computes its prompt's chunks there — one run where there were two (cut
at the landing, then planned again). The replay must not change: fast-forwarded with
joins, it equals the same replay step by step and fast-forwarded without them, bit
for bit — also where an arrival cuts a joined run before the landing, and where
another rank's fetch plays one part-way, across it."""

from collections import Counter

import pandas as pd
import pytest

from support import small_agentx
from labkit import Engine, generate_agentx_trace
from labkit.engine import run_plan
from labkit.engine.decode_run import DecodeRun
from labkit.engine.events import FirstToken

# many calls moved between ranks, their prefixes fetched while the others decode
MOVES = dict(model="qwen3-30b-a3b", layout="dp4", hardware="h200", max_model_len=262144)
SMALL = {  # a tp8 replica's KV crosses the network for several steps
    "tp8xdp2 round-robin": dict(model="llama-3.1-8b", layout="tp8xdp2", router="round_robin"),
    "interval 3, small budget": dict(model="llama-3.1-8b", layout="tp8xdp2",
                                     router="round_robin", max_num_batched_tokens=384,
                                     prefill_schedule_interval=3),
    "sync scheduling, spec decode": dict(model="llama-3.1-8b", layout="tp8xdp2",
                                         router="round_robin", async_scheduling=False,
                                         num_speculative_tokens=2, acceptance_length=2.5,
                                         max_num_batched_tokens=512),
}


def _watch(monkeypatch, seen: Counter, joins: bool = True) -> None:
    """Count joins, and the cuts and part-way plays of joined runs around the landing
    (`joins=False`: no run is joined)."""
    join, truncate, play = run_plan._join_landing, DecodeRun.truncate, DecodeRun.play

    def joining(*args):
        joined = join(*args) if joins else None
        seen["joined"] += joined is not None
        return joined

    def truncating(run, steps):
        if run.lands and run.land_step and steps < run.steps:
            seen["cut before the landing" if steps <= run.land_step else "cut after"] += 1
        truncate(run, steps)

    def playing(run, alloc_stop, commit_stop):
        if run.lands and run.land_step and run.committed <= run.land_step < \
                max(alloc_stop, commit_stop) < run.steps:
            seen["played part-way across the landing"] += 1
        return play(run, alloc_stop, commit_stop)

    monkeypatch.setattr(run_plan, "_join_landing", joining)
    monkeypatch.setattr(DecodeRun, "truncate", truncating)
    monkeypatch.setattr(DecodeRun, "play", playing)


def _replay(cfg: dict, trace, ff: bool = True, **options):
    engine = Engine(sim_fast_forward=ff, **cfg)
    firsts = []
    engine.events.subscribe(lambda e: firsts.append((e.t, e.request_id, e.rank)), FirstToken)
    result = engine.replay(trace, **options)
    return result, sorted(firsts), engine.step_recorder.num_events


def _assert_same(a, b) -> None:
    pd.testing.assert_frame_equal(a.requests, b.requests, check_exact=True)
    pd.testing.assert_frame_equal(a.steps, b.steps, check_exact=True)
    drop = {"wall_s", "sim_speed"}
    assert a.summary.keys() == b.summary.keys()
    for key in a.summary.keys() - drop:  # (NaN: a figure with no samples, in both)
        x, y = a.summary[key], b.summary[key]
        assert x == y or (x != x and y != y), key


def test_runs_joined_at_a_landing_change_nothing(monkeypatch):
    trace = generate_agentx_trace(200, seed=11, context_window_tokens=200_000,
                                  compact_threshold_tokens=166_000)
    options = dict(concurrency=40, duration_s=200, start_part_way=False)
    seen, apart = Counter(), Counter()
    _watch(monkeypatch, seen)
    joined, joined_firsts, joined_rounds = _replay(MOVES, trace, **options)
    assert seen["joined"] > 100
    assert seen["cut before the landing"] and seen["played part-way across the landing"]
    assert joined.summary["kv_fetched_tokens"] > 0

    step_by_step, firsts, _ = _replay(MOVES, trace, ff=False, **options)
    _assert_same(joined, step_by_step)
    assert joined_firsts == firsts

    _watch(monkeypatch, apart, joins=False)
    unjoined, _, unjoined_rounds = _replay(MOVES, trace, **options)
    assert apart["joined"] == 0
    _assert_same(joined, unjoined)
    # the point of it: a joined run is one round where there were two
    assert joined_rounds <= unjoined_rounds - seen["joined"] // 2


@pytest.mark.parametrize("name", list(SMALL))
def test_joined_runs_under_chunking_knobs_are_exact(name, monkeypatch):
    seen = Counter()
    _watch(monkeypatch, seen)
    cfg = dict(hardware="h100", block_size=16, **SMALL[name])
    options = dict(concurrency=4, duration_s=60, max_idle_s=2.0, start_part_way=True)
    fast, fast_firsts, _ = _replay(cfg, small_agentx(6, seed=3), **options)
    slow, slow_firsts, _ = _replay(cfg, small_agentx(6, seed=3), ff=False, **options)
    assert seen["joined"] > 0
    _assert_same(fast, slow)
    assert fast_firsts == slow_firsts
