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
import pandas as pd
import pytest

from support import small_agentx
from labkit import Engine, generate_agentx_trace
from labkit.engine import run_plan
from labkit.engine.decode_run import DecodeRun
from labkit.engine.events import FirstToken
from labkit.engine.kv.block_pool import NO_KEY

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


def _kv_state(engine, t: float) -> list:
    """Every rank's blocks as step-by-step simulation has them at t (a run under way is
    played up to t): the blocks in use or cached with their references, keys,
    generations and pending marks, the next blocks to be evicted, the block tables."""
    for instance in engine.instances:
        instance.sync(t, cut=False)
    state = []
    for s in engine.schedulers:
        pool = s.kv.pool
        held = np.nonzero((pool.ref_count > 0) | (pool.block_key != NO_KEY))[0]
        state.append([held, pool.ref_count[held], pool.block_key[held],
                      pool.generation[held], pool.pending[held],
                      pool.next_to_evict(min(pool.num_free, 5000))])
        state[-1] += [(rid, table.view(), table.num_keyed, table.num_written)
                      for rid, table in sorted(s.kv.tables.items())]
    return state


def _assert_same_kv(a: list, b: list, t: float) -> None:
    assert len(a) == len(b)
    for rank_a, rank_b in zip(a, b):
        assert len(rank_a) == len(rank_b), t
        for x, y in zip(rank_a, rank_b):
            if isinstance(x, tuple):  # a block table
                assert x[0] == y[0] and np.array_equal(x[1], y[1]) and x[2:] == y[2:], t
            else:
                assert np.array_equal(x, y), t


def _assert_same(a, b) -> None:
    pd.testing.assert_frame_equal(a.requests, b.requests, check_exact=True)
    pd.testing.assert_frame_equal(a.steps, b.steps, check_exact=True)
    drop = {"wall_s", "sim_speed"}
    assert a.summary.keys() == b.summary.keys()
    for key in a.summary.keys() - drop:  # (NaN: a figure with no samples, in both)
        x, y = a.summary[key], b.summary[key]
        assert x == y or (x != x and y != y), key


TRACE = dict(num_sessions=200, seed=11, context_window_tokens=200_000,
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
    _assert_same(joined, step_by_step)
    assert joined_firsts == firsts

    _watch(monkeypatch, apart, joins=False)
    unjoined, _, unjoined_rounds = _replay(MOVES, trace, **OPTIONS)
    assert apart["joined"] == 0
    _assert_same(joined, unjoined)
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
            at, ends = joined.land_step, joined.ends
            looks.extend([(joined.start[at - 1] + ends[at - 1]) / 2,
                          (joined.start[at] + ends[at]) / 2])
            heapq.heapify(looks)
        return joined

    monkeypatch.setattr(run_plan, "_join_landing", joining)
    engines = [Engine(sim_fast_forward=ff, **MOVES) for ff in (True, False)]
    runs = [engine.start_replay(trace, **OPTIONS) for engine in engines]
    heapq.heapify(looks)
    seen = 0
    while looks:
        t = float(heapq.heappop(looks))
        states = []
        for engine in engines:
            while engine.next_event_time() < t:  # (`run_until` would end runs at t)
                engine.process_event()
            states.append(_kv_state(engine, t))
        _assert_same_kv(*states, t)
        seen += 1
    assert seen > 400
    _assert_same(*(run.finish() for run in runs))


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
