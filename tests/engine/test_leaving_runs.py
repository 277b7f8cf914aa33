"""A call that finishes leaves a fast-forwarded run, the others decoding on
(`DecodeRun.stops`): the instance commits the run up to the finish, frees the call's
KV, tells whoever waits for it, and goes on — one run where there were two (ended at
the finish, then planned again). The replay must not change: it equals the same
replay step by step and fast-forwarded with every run ending at its first finish,
bit for bit, and every rank's KV is the same at any time, the steps around a leaving
included."""

import heapq
from collections import Counter

import numpy as np
import pytest

from support import assert_kv_as_step_by_step, assert_same_replay, small_agentx, step_middles
from labkit import Engine, generate_agentx_trace
from labkit.engine import run_plan
from labkit.engine.instance import Instance
from labkit.engine.run_plan import decode_rows
from labkit.engine.step_work import StepWork

# calls moved between ranks (prefixes on the wire while the others decode), prompts
# computed chunk by chunk beside decodes, many calls finishing in the middle of runs
MOVES = dict(model="qwen3-30b-a3b", layout="dp4", hardware="h200", max_model_len=262144)
TRACE = dict(num_sessions=200, seed=11, context_window_tokens=200_000,
             compact_threshold_tokens=166_000)
OPTIONS = dict(concurrency=40, duration_s=200, start_part_way=False)
SMALL = {
    "spec decode, sliding window": dict(model="tiny-gpt-oss", layout="dp2",
                                        num_speculative_tokens=2, acceptance_length=2.5),
    "sync scheduling, small budget, interval 3": dict(
        model="llama-3.1-8b", layout="tp8xdp2", router="round_robin",
        async_scheduling=False, max_num_batched_tokens=384, prefill_schedule_interval=3),
}


def _watch(monkeypatch, seen: Counter, leave: bool = True) -> None:
    """Count the runs planned, those some call leaves (with prompt chunks in them or
    not) and the commits at a leaving (`leave=False`: every run ends at its first
    finish, as before)."""
    plan, commit = run_plan.plan_decode_run, Instance._commit_to_finish
    may_leave = Instance._may_leave

    def planning(*args, **kwargs):
        run = plan(*args, **kwargs)
        seen["runs"] += run is not None
        if run is not None and run.stops:
            seen["left with chunks" if run.prefill is not None else "left"] += 1
        return run

    def committing(instance, plan, stop):
        seen["commits at a leaving"] += 1
        return commit(instance, plan, stop)

    import labkit.engine.instance as instance_module
    monkeypatch.setattr(instance_module, "plan_decode_run", planning)
    monkeypatch.setattr(Instance, "_commit_to_finish", committing)
    monkeypatch.setattr(Instance, "_may_leave",
                        may_leave if leave else lambda self: False)


def _replay(cfg: dict, trace, ff: bool = True, **options):
    return Engine(sim_fast_forward=ff, **cfg).replay(trace, **options)


def test_calls_leave_runs_and_change_nothing(monkeypatch):
    trace = generate_agentx_trace(**TRACE)
    seen, apart = Counter(), Counter()
    _watch(monkeypatch, seen)
    leaving = _replay(MOVES, trace, **OPTIONS)
    assert seen["commits at a leaving"] > 200, seen
    assert seen["left with chunks"] > 100 and seen["left"], seen
    assert leaving.summary["kv_fetched_tokens"] > 0

    assert_same_replay(leaving, _replay(MOVES, trace, ff=False, **OPTIONS))

    _watch(monkeypatch, apart, leave=False)
    staying = _replay(MOVES, trace, **OPTIONS)
    assert apart["commits at a leaving"] == 0 and apart["left"] == 0
    assert_same_replay(leaving, staying)
    # the point of it: fewer runs planned for the same steps
    assert seen["runs"] < 0.8 * apart["runs"], (seen, apart)


def test_runs_left_leave_the_kv_as_single_steps_do(monkeypatch):
    """Every rank's blocks, looked at every 0.61 s and in the middle of the step that
    finishes a call inside a run and of the step after it (each look plays the runs
    under way up to then), are those of the replay step by step."""
    trace = generate_agentx_trace(**TRACE)
    looks = np.arange(0.7, OPTIONS["duration_s"], 0.61).tolist()
    plan = run_plan.plan_decode_run

    def planning(*args, **kwargs):
        run = plan(*args, **kwargs)
        for stop in run.stops if run is not None else ():
            looks.extend(step_middles(run, stop))
        heapq.heapify(looks)
        return run

    import labkit.engine.instance as instance_module
    monkeypatch.setattr(instance_module, "plan_decode_run", planning)
    seen = assert_kv_as_step_by_step(MOVES, trace, looks, **OPTIONS)
    assert seen > 900


@pytest.mark.parametrize("name", list(SMALL))
def test_leaving_under_other_knobs_is_exact(name, monkeypatch):
    seen = Counter()
    _watch(monkeypatch, seen)
    cfg = dict(hardware="h100", block_size=16, **SMALL[name])
    options = dict(concurrency=12, duration_s=60, max_idle_s=2.0, start_part_way=True)
    fast = _replay(cfg, small_agentx(16, seed=3), **options)
    assert seen["commits at a leaving"] > 10 and seen["left"], seen
    assert_same_replay(fast, _replay(cfg, small_agentx(16, seed=3), ff=False, **options))


def test_lockstep_ranks_end_a_run_at_its_first_finish(monkeypatch):
    """DEP ranks price a new shape of step at every leaving: their runs end at the
    first finish (`Instance._may_leave`)."""
    seen = Counter()
    _watch(monkeypatch, seen)
    engine = Engine("tiny-qwen3-moe", "dep4", "h100", block_size=16)
    engine.replay(small_agentx(6, seed=1), concurrency=4, duration_s=30)
    assert seen["runs"] > 10 and seen["commits at a leaving"] == 0


def test_decode_rows_of_calls_leaving_are_their_entries_summed():
    """`decode_rows` (counts fixed between two leavings) against `StepWork.from_entries`
    on the same (request, step) entries, for random runs over two ranks."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        n, k, width = int(rng.integers(1, 7)), int(rng.integers(1, 40)), int(rng.integers(1, 4))
        rank_of = np.sort(rng.integers(0, 2, n))
        cum = np.concatenate([[0], np.cumsum(rng.integers(1, 4, k))]).astype(np.int64)
        held0 = rng.integers(1, 5000, n).astype(np.int64)
        done = rng.integers(1, k + 5, n).astype(np.int64)
        done[rng.integers(n)] = k + int(rng.integers(0, 3))  # (a run ends at the last)
        held = held0[:, None] + cum[None, :k]
        new = np.where(np.arange(k)[None, :] < done[:, None], width, 0).astype(np.int64)
        want = StepWork.from_entries(rank_of, 2, held, new, np.zeros((n, k), dtype=bool))
        rows, splits = decode_rows(rank_of, 2, held0, done, cum, width)
        assert list(splits) == sorted(set(done.tolist()))[:-1]
        for a, b in ((0, k), (0, max(1, k // 2)), (k // 3, k)):
            if a >= b:
                continue
            got, ref = rows(a, b), want.rows(a, b)
            for name in ("prefill_tokens", "decode_tokens", "num_prefill_reqs",
                         "num_decode_reqs", "kv_read_tokens", "prefill_pairs",
                         "decode_pairs", "idle", "decode_context"):
                assert np.array_equal(getattr(got, name), getattr(ref, name)), (name, a, b)
