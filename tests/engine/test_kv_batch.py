"""A fast-forwarded run's KV work in one batch per rank equals it call by call.

`DecodeRun` plays a run's block allocations and prefix-cache registrations on a rank
as one batch (`KVManager.plan_batch` / `play_batch`). The reference here is what
step-by-step simulation does: each step, `allocate` for every request, then once the
step has run, `cache_full_blocks` for every request. Random prompts share prefixes
with finished calls whose blocks sit cached in the free queue, so batches evict
cached blocks, and some keys a run registers are cached already (the case where a
batch could differ: `plan_batch` must decline it, changing nothing).
"""

import copy
from collections import Counter

import numpy as np

from support import assert_same_kv, assert_same_replay
from labkit.engine.kv import KVManager, TraceBlockKeys
from labkit.engine.kv.block_pool import BlockPool
from labkit.engine.request import Request

BS = 4


def _request(name: str, ids: np.ndarray, prompt: int, output: int) -> Request:
    return Request(name, "s", prompt, output, 0.0, keys=TraceBlockKeys(ids, BS, BS),
                   max_tokens=prompt + output)


def _admit(kv: KVManager, req: Request) -> bool:
    match = kv.lookup(req)
    if not kv.allocate(req, req.num_prompt_tokens - match.num_tokens, match):
        return False
    req.num_computed_tokens = req.num_prompt_tokens
    kv.cache_full_blocks(req)
    return True


def _setup(rng: np.random.Generator):
    """A pool with finished calls cached in its free queue and a few running ones."""
    kv = KVManager(int(rng.integers(24, 64)), BS)
    trunk = rng.integers(0, 10**6, size=40)
    running = []
    for n in range(int(rng.integers(2, 6))):
        ids = trunk.copy()  # shares the trunk up to `cut` (all of it: the same call)
        cut = 40 if rng.random() < 0.15 else int(rng.integers(1, 40))
        ids[cut:] = rng.integers(0, 10**6, size=40 - cut)
        prompt = int(rng.integers(2, 60))
        req = _request(f"h{n}", ids, prompt, 40 * BS - prompt)
        if _admit(kv, req) and rng.random() < 0.6:
            # decode a little, then finish: its blocks stay cached, free
            req.num_computed_tokens += int(rng.integers(0, 12))
            kv.allocate(req, 0)
            kv.cache_full_blocks(req)
            kv.free(req)
        elif kv.tables.get(req.request_id) is not None:
            running.append(req)
    return kv, running


def _reference(kv, reqs, steps: int, extra: int) -> None:
    """Step by step: allocations when a step starts, registrations when it ends; then
    `extra` more steps' allocations (a run played up to where a step is in flight)."""
    for j in range(steps + extra):
        for req in reqs:
            req.num_computed_tokens += j
            assert kv.allocate(req, 1)
            req.num_computed_tokens -= j
        if j < steps:
            for req in reqs:
                req.num_computed_tokens += j + 1
                kv.cache_full_blocks(req)
                req.num_computed_tokens -= j + 1


def _batch(kv, reqs, steps: int, extra: int):
    """The same as one plan (None if declined), counted as `DecodeRun` counts it."""
    have = np.array([kv.tables[r.request_id].n for r in reqs], dtype=np.int64)
    before = np.array([r.num_computed_tokens for r in reqs], dtype=np.int64)
    need = -(-(before[:, None] + np.arange(steps + extra) + 1) // BS)
    held = np.maximum.accumulate(np.maximum(need, have[:, None]), axis=1)
    counts = np.diff(np.concatenate([have[:, None], held], axis=1), axis=1)
    return kv.plan_batch(reqs, counts, steps, before + steps)


def _state(kv, reqs):
    pool = kv.pool
    return (
        [(kv.tables[r.request_id].view().tolist(), kv.tables[r.request_id].num_keyed,
          kv.tables[r.request_id].num_written) for r in reqs],
        pool.free_order().tolist(), pool._cached.as_dict(), pool.num_free,
        *(a[: pool._free.fresh].tolist() for a in (pool.ref_count, pool.block_key,
                                                   pool.generation, pool.pending)),
    )


def test_batch_equals_calls_one_by_one():
    played = declined = 0
    for seed in range(400):
        rng = np.random.default_rng(seed)
        kv, reqs = _setup(rng)
        if not reqs:
            continue
        steps, extra = int(rng.integers(0, 14)), int(rng.integers(0, 2))
        ref_kv, ref_reqs = copy.deepcopy((kv, reqs))
        try:
            _reference(ref_kv, ref_reqs, steps, extra)
        except AssertionError:
            continue  # the pool runs short: no run is planned this far
        start = _state(kv, reqs)
        plan = _batch(kv, reqs, steps, extra)
        if plan is None:
            declined += 1
            assert _state(kv, reqs) == start  # declining changes nothing
            to_register = [int(k) for r in reqs
                           for k in r.keys.keys(kv.tables[r.request_id].num_keyed,
                                                min(r.keys.num_blocks,
                                                    (r.num_computed_tokens + steps) // BS))]
            assert len(set(to_register)) < len(to_register) or any(
                kv.pool.cached_block(k) >= 0 for k in to_register)
            continue
        kv.play_batch(plan)
        played += 1
        assert _state(kv, reqs) == _state(ref_kv, ref_reqs), seed
    assert played > 80 and declined > 10, (played, declined)


def test_declined_batches_would_differ(monkeypatch):
    """The decline is not vacuous: forced through, some declined batches leave a state
    other than the calls one by one (a key the run registers was held by a block the
    batch evicts before, not after, its registration)."""
    monkeypatch.setattr(BlockPool, "all_uncached",  # distinct keys, cached or not
                        lambda self, keys: len(set(keys.tolist())) == len(keys))
    differ = 0
    for seed in range(400):
        rng = np.random.default_rng(seed)
        kv, reqs = _setup(rng)
        steps, extra = int(rng.integers(0, 14)), int(rng.integers(0, 2))
        ref_kv, ref_reqs = copy.deepcopy((kv, reqs))
        try:
            _reference(ref_kv, ref_reqs, steps, extra)
        except AssertionError:
            continue
        plan = _batch(kv, reqs, steps, extra) if reqs else None
        if plan is not None:
            kv.play_batch(plan)
            differ += _state(kv, reqs) != _state(ref_kv, ref_reqs)
    assert differ > 0


def test_a_playbacks_kv_events_match_their_definition():
    """`_kv_events` (one compiled pass) against its definition in numpy: each request's
    calls, the ranks registering a prefill chunk or a landed prefix in a step played
    only up to its start (late), the last step each rank allocates / registers a
    chunk or landed prefix / fills in, the tokens of requests that register."""
    from labkit.engine.kv.batch_play import NONE, _kv_events

    def last(mask) -> int:
        hits = mask.nonzero()[0]
        return int(hits[-1]) if len(hits) else NONE

    rng = np.random.default_rng(5)
    seen = Counter()
    for _ in range(600):
        n, k = int(rng.integers(1, 7)), int(rng.integers(1, 12))
        cuts = np.sort(rng.choice(np.arange(1, n), size=int(rng.integers(0, n)), replace=False))
        lo = np.concatenate([[0], cuts]).astype(np.int64)
        hi = np.append(lo[1:], n)
        start = int(rng.integers(0, k))
        alloc_stop = int(rng.integers(start, k + 2))  # (past the run: stops at its end)
        first = int(rng.integers(0, start + 1))
        kv_calls = rng.random((n, k)) < 0.3
        fills = rng.random((n, int(rng.integers(0, 5)))) < 0.3
        after = rng.integers(0, 10_000, size=n)
        with_chunks = rng.random() < 0.5
        prefill = rng.random((n, k)) < 0.15 if with_chunks else kv_calls[:, :0]
        land_step = int(rng.integers(start, max(start + 1, min(alloc_stop, k))))
        landing = (rng.random(n) < 0.2) & with_chunks
        calls, late, la, lf, lr, tokens = _kv_events(kv_calls, prefill, fills, landing,
                                                     after, lo, start, first, alloc_stop,
                                                     land_step)
        want = kv_calls[:, start:alloc_stop].sum(axis=1) + fills.sum(axis=1)
        if with_chunks:
            want = want + prefill[:, start:alloc_stop].sum(axis=1) + landing
        assert calls.tolist() == want.tolist()
        registers = fills.any(axis=1) | landing
        assert tokens.tolist() == np.where(registers, after, -1).tolist()
        commit_stop = first + fills.shape[1]
        for r, (a, b) in enumerate(zip(lo, hi)):
            chunks = np.zeros(k, dtype=bool)  # steps in which the rank registers a
            if with_chunks:                   # chunk or a landed prefix as they start
                chunks[start:alloc_stop] = prefill[a:b, start:alloc_stop].any(axis=0)
                chunks[land_step] |= landing[a:b].any()
            assert late[r] == chunks[commit_stop:].any()
            seen["late"] += bool(late[r])
            seen["chunks in time"] += chunks.any() and not late[r]
            assert la[r] == last(kv_calls[a:b, start:alloc_stop].any(axis=0))
            assert lr[r] == last(chunks[start:])
            assert lf[r] == last(fills[a:b].any(axis=0))
    assert seen["late"] > 50 and seen["chunks in time"] > 50


def test_runs_played_in_batches_leave_what_calls_one_by_one_leave(monkeypatch):
    """Whole runs — prefill chunks and prefixes fetched from another rank landing
    among the decodes included — played a batch per rank leave every rank's blocks,
    its time stamp and the running calls' progress (tokens computed, KV arrived) as
    the same runs played call by call do, looked at every 0.37 s (each look plays the
    runs under way up to then)."""
    from support import kv_state

    from labkit import Engine, generate_agentx_trace
    from labkit.engine.kv import batch_play

    trace = generate_agentx_trace(120, seed=11, context_window_tokens=200_000,
                                  compact_threshold_tokens=166_000)
    looks = np.arange(0.4, 200, 0.37).tolist()
    kv_events, seen = batch_play._kv_events, Counter()

    def counting(*args):
        out = kv_events(*args)
        calls, late, last_reg, rank_lo = out[0], out[1], out[4], args[5]
        for r, lo in enumerate(rank_lo.tolist()):
            hi = rank_lo[r + 1] if r + 1 < len(rank_lo) else len(calls)
            if last_reg[r] != batch_play.NONE and not late[r] \
                    and calls[lo:hi].sum() >= batch_play.BATCH_EVENTS:
                seen["chunks or a landing offered to a batch"] += 1
                seen["with a landing"] += bool(args[3][lo:hi].any())
        return out

    def looked() -> list:
        engine = Engine(model="qwen3-30b-a3b", layout="dp4", hardware="h200",
                        max_model_len=262144)
        run, states = engine.start_replay(trace, concurrency=40, duration_s=200,
                                          start_part_way=False), []
        for t in looks:
            while engine.next_event_time() < t:
                engine.process_event()
            state = kv_state(engine, t)
            for s in engine.schedulers:
                state.append((s.kv.pool.now, [(r.request_id, r.num_computed_tokens,
                                               r.kv_ready_s) for r in s.running]))
            states.append(state)
        return states, run.finish()

    monkeypatch.setattr(batch_play, "_kv_events", counting)
    batched, batched_result = looked()
    assert seen["chunks or a landing offered to a batch"] > 60 and seen["with a landing"] > 40, seen
    monkeypatch.setattr(batch_play, "BATCH_EVENTS", 1 << 60)  # every call one by one
    one_by_one, result = looked()
    for t, a, b in zip(looks, batched, one_by_one):
        assert_same_kv(a[:-4], b[:-4], t)
        assert a[-4:] == b[-4:], t
    assert_same_replay(batched_result, result)
