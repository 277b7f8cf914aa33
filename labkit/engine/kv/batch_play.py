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

Prefill chunks (`chunk_run.py`) and a prefix copied in from elsewhere, registered
when their step starts (between the allocations), batch as well: registering moves no
block in the queue, and a block registered as its step starts and marked written as
it ends is, once the step has ended, what one registered then — so the batch
registers them with the blocks filled, and marks a landed request's KV arrived.

A batch is declined, and the calls are made one by one (`DecodeRun._play_in_order`),
where it could differ or where nobody can tell cheaply that it would not:

- a chunk or a landed prefix is registered in a step played only up to its start
  (its blocks stay marked as being computed);
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
from numba import njit

from labkit.engine.events import BlocksAllocated, BlocksCached, BlocksEvicted

# a rank's KV work in a playback is done in one batch from this many calls on (below,
# one batch costs more than the calls; on the fast workload of `labkit bench sim`, 3
# plays ~2-3 % faster than 6, 2 the same as 3)
BATCH_EVENTS = 3
NONE = -(1 << 40)  # `_kv_events`: no such step (below any index, even offset)


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
        taken = counts[:, :committed].sum(axis=1).tolist()  # blocks taken before
        for req, table, before, num in zip(reqs, tables, taken, tokens.tolist()):
            if num < 0 or req.keys is None:
                continue
            held = table.n + before
            full = min(num // kv.block_size, req.keys.num_blocks, held)
            if full > table.num_written:
                keys = req.keys.keys(table.num_keyed, max(full, table.num_keyed))
                registered.append((table, full, keys))
    if registered and not pool.all_uncached(_joined([k for _, _, k in registered])):
        return None
    return BatchPlan(tables, counts, registered)


def play_batch(kv, plan: BatchPlan) -> None:
    """Do what `plan_batch` planned: one pool allocation, handed out to the tables in
    the order the calls one by one would take the blocks (step by step, then request
    by request), then one registration of every block filled."""
    tables, counts, registered = plan.tables, plan.counts, plan.registered
    per_table = counts.sum(axis=1).tolist()
    total = sum(per_table)
    if total:
        blocks = kv.pool.allocate(total)
        if total in per_table:  # one table takes them all
            tables[per_table.index(total)].extend(blocks)
        else:
            dealt, first = _by_table(blocks, counts), 0
            for table, m in zip(tables, per_table):
                if m:
                    table.extend(dealt[first : first + m])
                first += m
    register(kv, registered)


def register(kv, registered: list) -> None:
    """The registrations `cache_full_blocks` would make for each (table, blocks to be
    full, their keys from table.num_keyed on), in that order, as one: one claim of all
    the keys in order (the first block to claim a key keeps it, as call by call), then
    every block filled marked written."""
    if not registered:
        return
    kv.pool.cache_blocks(_joined([t.blocks[t.num_keyed : full] for t, full, _ in registered]),
                         _joined([k for _, _, k in registered]))
    kv.pool.written(_joined([t.blocks[t.num_written : full] for t, full, _ in registered]))
    for table, full, _ in registered:
        table.num_keyed = max(table.num_keyed, full)
        table.num_written = full


def play_run_in_batches(run, first: int, alloc_stop: int, after, fills, ends) -> list:
    """A run's KV work in the steps being played (`DecodeRun.play`: allocations of
    steps [run.allocated, alloc_stop), registrations of those ending from `first` on;
    `after`, `fills` as there), a rank at a time. Returns the requests (rows
    of `run.pairs`) left to play call by call: those of ranks with few calls, or where
    the rank cannot tell that a batch gives the same result."""
    start = run.allocated
    ranks = _ranks(run.pairs)
    # A request without calls takes nothing and registers nothing (it may stay in a
    # batch); one taking in a landed prefix registers it as the step starts.
    landing = np.zeros(len(run.pairs), dtype=np.bool_)
    if start <= run.land_step < alloc_stop:
        landing[list(run.lands)] = True
    prefill = run.prefill if run.prefill is not None else run.kv_calls[:, :0]
    calls, late, la, lf, lr, tokens = _kv_events(
        run.kv_calls, prefill, fills, landing,
        after[:, -1] if after.shape[1] else np.zeros(len(run.pairs), dtype=np.int64),
        np.array([lo for _, lo, _ in ranks], dtype=np.int64), start, first, alloc_stop,
        run.land_step)
    committed = max(0, first + fills.shape[1] - start)  # steps registering before the rest
    calls, left = calls.tolist(), []
    for r, (scheduler, lo, hi) in enumerate(ranks):
        if sum(calls[lo:hi]) < BATCH_EVENTS or late[r] or not plays_in_batches(scheduler.kv):
            left += [i for i in range(lo, hi) if calls[i]]
            continue
        kv, reqs = scheduler.kv, [req for _, req in run.pairs[lo:hi]]
        # blocks request i takes when step j starts, as the run planned them (without
        # sliding-window pages, what `KVManager.allocate` finds then)
        counts = run.new_blocks[lo:hi, start:alloc_stop]
        plan = plan_batch(kv, reqs, counts, committed, tokens[lo:hi])
        if plan is None:
            left += [i for i in range(lo, hi) if calls[i]]
            continue
        play_batch(kv, plan)
        for i in range(lo, hi):
            if landing[i]:  # (as `Scheduler._schedule_running` takes it in)
                run.pairs[i][1].kv_ready_s = 0.0
        # the time stamp the pool is left with: its last event's (register at boundary
        # j + 1 = ends[j]; allocate, register a chunk or a landed prefix at boundary
        # j = start[j]: the same time)
        last_start, last_fill = max(la[r], lr[r]) + start, lf[r] + first + 1
        kv.set_time(float(run.start[last_start]) if last_start >= last_fill
                    else float(ends[last_fill - 1]))
    return sorted(left)


# (one signature, any layout: contiguous or sliced arrays would each load a compiled
# copy of their own in every process)
@njit("(boolean[:, :], boolean[:, :], boolean[:, :], boolean[:], int64[:], int64[:], int64, "
      "int64, int64, int64)", cache=True)
def _kv_events(kv_calls, prefill, fills, landing, last_after, rank_lo, start: int,
               first: int, alloc_stop: int, land_step: int):
    """What `play_run_in_batches` reads of a run's steps being played, in one pass:
    each request's KV calls (allocations in steps [start, alloc_stop), blocks filled
    in the steps ending, [first, first + fills' width), prefill chunks registered and
    a landed prefix taken in (`landing`, at land_step) as steps [start, alloc_stop)
    start); per rank whether a chunk or a landed prefix is registered in a step that
    does not end here (late), the last step (from `start`) in which one of its requests
    allocates, and in which one registers a chunk or a landed prefix, and the last
    (from `first`) in which one fills a block (NONE if none); each request's tokens
    with KV after its steps if it registers anything (-1 if not)."""
    n = kv_calls.shape[0]
    ranks = len(rank_lo)
    alloc_stop = min(alloc_stop, kv_calls.shape[1])  # (as a slice would stop)
    commit_stop = first + fills.shape[1]  # steps from here on do not end
    calls = np.zeros(n, dtype=np.int64)
    late = np.zeros(ranks, dtype=np.bool_)
    last_alloc = np.full(ranks, NONE, dtype=np.int64)
    last_fill = np.full(ranks, NONE, dtype=np.int64)
    last_reg = np.full(ranks, NONE, dtype=np.int64)
    tokens = np.full(n, -1, dtype=np.int64)
    r = -1
    for i in range(n):
        while r + 1 < ranks and rank_lo[r + 1] <= i:
            r += 1
        for j in range(start, alloc_stop):
            if kv_calls[i, j]:
                calls[i] += 1
                last_alloc[r] = max(last_alloc[r], j - start)
        for j in range(fills.shape[1]):
            if fills[i, j]:
                calls[i] += 1
                last_fill[r] = max(last_fill[r], j)
                tokens[i] = last_after[i]
        if prefill.shape[1]:
            for j in range(start, alloc_stop):
                if prefill[i, j]:
                    calls[i] += 1
                    last_reg[r] = max(last_reg[r], j - start)
                    late[r] |= j >= commit_stop
            if landing[i]:
                calls[i] += 1
                last_reg[r] = max(last_reg[r], land_step - start)
                late[r] |= land_step >= commit_stop
                tokens[i] = last_after[i]
    return calls, late, last_alloc, last_fill, last_reg, tokens


def _ranks(pairs) -> list:
    """(scheduler, lo, hi): the rows of each rank's requests (`pairs` lists them a rank
    at a time)."""
    out = []
    for i, (scheduler, _) in enumerate(pairs):
        if out and out[-1][0] is scheduler:
            out[-1][2] = i + 1
        else:
            out.append([scheduler, i, i + 1])
    return out


def _joined(arrays: list) -> np.ndarray:
    """The arrays end to end (the one itself, uncopied, when there is one)."""
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


@njit("(int32[:], int64[:, :])", cache=True)  # (any layout, as `_kv_events`)
def _by_table(blocks, counts):
    """`blocks`, taken step by step and request by request (counts[i, j] by request i
    in step j), regrouped request by request: request 0's in the order it took them,
    then request 1's, ..."""
    n, steps = counts.shape
    at = np.zeros(n, dtype=np.int64)  # where request i's next block goes
    for i in range(1, n):
        at[i] = at[i - 1] + counts[i - 1].sum()
    out = np.empty_like(blocks)
    taken = 0
    for j in range(steps):
        for i in range(n):
            for _ in range(counts[i, j]):
                out[at[i]] = blocks[taken]
                at[i] += 1
                taken += 1
    return out
