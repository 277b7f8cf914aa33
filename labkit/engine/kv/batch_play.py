"""Batched playback: a fast-forwarded run's KV work on a rank, done in one go.

A fast-forwarded run (`decode_run.py`) is played back as step-by-step simulation
would have done it: when step j starts, every request that needs a new block takes
one (`KVManager.allocate`); when it ends, every request that filled a block registers
it in the prefix cache (`KVManager.cache_full_blocks`). Done call by call, that is
two Python calls per request and block — most of a long run's playback.

On one rank those calls can be done as **one batch**: one pool allocation for all the
blocks the rank's requests take in the steps played, handed to their tables in the
order the calls one by one would take them from the free queue (step by step, then
request by request), then one registration of all the blocks they fill. This is exact
because

- ranks have pools of their own, so the order between ranks does not matter;
- the free queue hands out the same blocks in the same order whatever registrations
  come in between (registering a block does not move it in the queue);
- the pool's time stamp is left at that of the last call it would have seen.

A batch is declined, and the calls are made one by one (`DecodeRun._play_in_order`),
where it could differ or where nobody can tell cheaply that it would not:

- a key to register is cached already, or twice: who holds it then depends on
  whether an eviction comes before or after the registration;
- the pool is short;
- sliding-window pages, state snapshots or offload write-through, whose work
  follows the calls' order; a subscriber to BlocksAllocated / BlocksEvicted /
  BlocksCached, which would see other groupings;
- fewer than `BATCH_EVENTS` calls on the rank (one batch costs more than a few calls).

`tests/engine/test_kv_batch.py` checks a batch against the calls one by one on
random pools, and that the declined batches would indeed differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from labkit.engine.events import BlocksAllocated, BlocksCached, BlocksEvicted

# a rank's KV work in a playback is done in one batch from this many calls on (below,
# one batch costs more than the calls)
BATCH_EVENTS = 6


@dataclass(slots=True)
class BatchPlan:
    """What `play_batch` does on one rank."""
    tables: list  # the requests' block tables, in the run's order
    counts: np.ndarray  # (n, steps): blocks request i takes when step j starts
    registered: list  # (table, blocks to be full, their keys from table.num_keyed on)


def plays_in_batches(kv) -> bool:
    """Can a run's allocations and registrations on `kv` be done a batch at a time?
    Only where nothing sees their order or grouping: no sliding-window pages, state
    snapshots or offload write-through, nobody listening to the per-call events."""
    wants = kv.events.wants
    return (kv.window is None and kv.snapshots is None and kv.on_cached is None
            and not (wants(BlocksAllocated) or wants(BlocksEvicted) or wants(BlocksCached)))


def plan_batch(kv, reqs, counts: np.ndarray, committed: int,
               tokens: np.ndarray) -> BatchPlan | None:
    """Plan steps of a run on `kv`'s rank as one batch: request i takes counts[i, j]
    blocks when step j starts (what `allocate` would add then); the first `committed`
    steps end, and register what they fill, before the later ones start; tokens[i]:
    req i's tokens with KV after them (-1: it fills no block). None where one batch
    could differ from those calls one by one (see the module docstring)."""
    pool = kv.pool
    if int(counts.sum()) > pool.num_free:
        return None
    tables = [kv.tables[r.request_id] for r in reqs]
    registered = []
    if pool.enable_caching:
        for req, table, row, num in zip(reqs, tables, counts, tokens.tolist()):
            if num < 0 or req.keys is None:
                continue
            held = table.n + int(row[:committed].sum())
            full = min(num // kv.block_size, req.keys.num_blocks, held)
            if full > table.num_written:
                keys = req.keys.keys(table.num_keyed, max(full, table.num_keyed))
                registered.append((table, full, keys))
    if registered:
        keys = np.concatenate([k for _, _, k in registered]).tolist()
        if len(set(keys)) != len(keys) or not pool.cached_none(keys):
            return None
    return BatchPlan(tables, counts, registered)


def play_batch(kv, plan: BatchPlan) -> None:
    """Do what `plan_batch` planned: one pool allocation, handed out to the tables in
    the order the calls one by one would take the blocks (step by step, then request
    by request), then one registration of every block filled."""
    tables, counts, registered = plan.tables, plan.counts, plan.registered
    total = int(counts.sum())
    if total:
        blocks = kv.pool.allocate(total)
        n, steps = counts.shape
        owner = np.repeat(np.tile(np.arange(n), steps), counts.T.ravel())
        for i, table in enumerate(tables):
            if counts[i].any():
                table.extend(blocks[owner == i])
    if not registered:
        return
    blocks = [t.blocks[t.num_keyed : full] for t, full, _ in registered]
    kv.pool.cache_blocks(np.concatenate(blocks), np.concatenate([k for _, _, k in registered]))
    kv.pool.written(np.concatenate([t.blocks[t.num_written : full]
                                    for t, full, _ in registered]))
    for table, full, _ in registered:
        table.num_keyed = max(table.num_keyed, full)
        table.num_written = full


def play_run_in_batches(run, first: int, alloc_stop: int, before, after, fills,
                        ends) -> list:
    """A run's KV work in the steps being played (`DecodeRun.play`: allocations of
    steps [run.allocated, alloc_stop), registrations of those ending from `first` on;
    `before`, `after`, `fills` as there), a rank at a time. Returns the requests (rows
    of `run.pairs`) left to play call by call: those of ranks with few calls, or where
    the rank cannot tell that a batch gives the same result."""
    pairs = run.pairs
    start = run.allocated
    calls = run.kv_calls[:, start:alloc_stop]
    per_request = calls.sum(axis=1) + fills.sum(axis=1)
    active = np.flatnonzero(per_request).tolist()
    by_rank: dict = {}  # scheduler -> positions in `active` of its requests
    for local, i in enumerate(active):
        by_rank.setdefault(pairs[i][0], []).append(local)
    left = []
    rows = np.array(active, dtype=np.int64)
    events = per_request[rows]
    batched = []
    for scheduler, local in by_rank.items():
        if events[local].sum() < BATCH_EVENTS or not plays_in_batches(scheduler.kv):
            left += [active[j] for j in local]
        else:
            batched += local
    if not batched:
        return left
    # blocks request i takes when step j starts, as `KVManager.allocate` would find
    # them: its slots (tokens so far + width) over the table it holds by then
    kv0 = pairs[active[0]][0].kv
    have = np.array([pairs[i][0].kv.tables[pairs[i][1].request_id].n for i in active],
                    dtype=np.int64)
    slots = before[rows, None] + run.cum[None, start:alloc_stop] - run.cum[first] + run.width
    need = np.where(calls[rows], -(-slots // kv0.block_size), 0)
    held = np.maximum.accumulate(np.maximum(need, have[:, None]), axis=1)
    counts = np.diff(np.concatenate([have[:, None], held], axis=1), axis=1)
    # a request's blocks registered: those full after its last step that fills one
    tokens = np.where(fills[rows].any(axis=1), after[rows, -1] if after.shape[1] else 0, -1)
    # the time stamp the rank's pool is left with: its last event's (register at
    # boundary j + 1 = ends[j], allocate at boundary j = start[j], register first)
    last_alloc = _last(calls[rows]) + start
    last_fill = _last(fills[rows]) + first + 1
    committed = max(0, first + fills.shape[1] - start)  # steps registering before the rest
    for scheduler, local in by_rank.items():
        if local[0] not in batched:
            continue
        reqs = [pairs[active[j]][1] for j in local]
        plan = plan_batch(scheduler.kv, reqs, counts[local], committed, tokens[local])
        if plan is None:
            left += [active[j] for j in local]
            continue
        la, lf = int(last_alloc[local].max()), int(last_fill[local].max())
        play_batch(scheduler.kv, plan)
        scheduler.kv.set_time(float(run.start[la]) if la >= lf else float(ends[lf - 1]))
    return sorted(left)


def _last(mask: np.ndarray) -> np.ndarray:
    """Per row, the index of its last True (a large negative number if none)."""
    if mask.shape[1] == 0:
        return np.full(len(mask), -(1 << 40), dtype=np.int64)
    last = mask.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1)
    return np.where(mask.any(axis=1), last, -(1 << 40))
