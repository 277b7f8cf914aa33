"""A run goes on through the landing of a call's prefix KV (`run_plan._join_landing`):
the call, on the wire while the others decode, joins the run at the step that takes
its KV in and computes its prompt's chunks there — one run where there were two (cut
at the landing, then planned again). The replay must not change: fast-forwarded with
joins, it equals the same replay step by step and fast-forwarded without them, bit
for bit — also where an arrival cuts a joined run before the landing, and where
another rank's fetch plays one part-way, across it."""

import heapq
from collections import Counter

import numpy as np
import pytest

from support import assert_kv_as_step_by_step, assert_same_replay, small_agentx, step_middles
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
    """(result, FirstToken events, step events)."""
    engine = Engine(sim_fast_forward=ff, **cfg)
    firsts = []
    engine.events.subscribe(lambda e: firsts.append((e.t, e.request_id, e.rank)), FirstToken)
    result = engine.replay(trace, **options)
    return result, sorted(firsts), engine.step_recorder.num_events


# (seed: an arrival cutting a joined run before its landing is rare, 0-3 times in 200
# s; this seed has 3)
TRACE = dict(num_sessions=200, seed=37, context_window_tokens=200_000,
             compact_threshold_tokens=166_000)
OPTIONS = dict(concurrency=40, duration_s=200, start_part_way=False)


def test_runs_joined_at_a_landing_change_nothing(monkeypatch):
    trace = generate_agentx_trace(**TRACE)
    seen, apart = Counter(), Counter()
    _watch(monkeypatch, seen)
    joined, joined_firsts, joined_rounds = _replay(MOVES, trace, **OPTIONS)
    assert seen["joined"] > 100
    assert seen["cut before the landing"] and seen["played part-way across the landing"]
    assert joined.summary["kv_fetched_tokens"] > 0

    step_by_step, firsts, _ = _replay(MOVES, trace, ff=False, **OPTIONS)
    assert_same_replay(joined, step_by_step)
    assert joined_firsts == firsts

    _watch(monkeypatch, apart, joins=False)
    unjoined, _, unjoined_rounds = _replay(MOVES, trace, **OPTIONS)
    assert apart["joined"] == 0
    assert_same_replay(joined, unjoined)
    # the point of it: a joined run is one round where there were two (fewer where an
    # arrival cuts it after the landing anyway)
    assert joined_rounds < unjoined_rounds


def test_joined_runs_leave_the_kv_as_single_steps_do(monkeypatch):
    """Every rank's blocks, looked at every 0.61 s and in the middle of the step before
    and of the step of every landing a run is joined at (each look plays the runs under
    way up to then), are those of the replay step by step."""
    trace = generate_agentx_trace(**TRACE)
    looks = np.arange(0.7, OPTIONS["duration_s"], 0.61).tolist()
    join = run_plan._join_landing

    def joining(*args):
        joined = join(*args)
        if joined is not None:
            looks.extend(step_middles(joined, joined.land_step))
            heapq.heapify(looks)
        return joined

    monkeypatch.setattr(run_plan, "_join_landing", joining)
    seen = assert_kv_as_step_by_step(MOVES, trace, looks, **OPTIONS)
    assert seen > 400


@pytest.mark.parametrize("name", list(SMALL))
def test_joined_runs_under_chunking_knobs_are_exact(name, monkeypatch):
    seen = Counter()
    _watch(monkeypatch, seen)
    cfg = dict(hardware="h100", block_size=16, **SMALL[name])
    options = dict(concurrency=4, duration_s=60, max_idle_s=2.0, start_part_way=True)
    fast, fast_firsts, _ = _replay(cfg, small_agentx(6, seed=3), **options)
    slow, slow_firsts, _ = _replay(cfg, small_agentx(6, seed=3), ff=False, **options)
    assert seen["joined"] > 0
    assert_same_replay(fast, slow)
    assert fast_firsts == slow_firsts
