"""The KV manager: block tables of one rank's requests over its block pool.

Each running request owns a **block table**: logical block i of its token stream lives
in physical block ``table[i]``. The manager

- finds the longest cached prefix of a new request (`lookup`), capped so that at least
  one token is recomputed (the model must produce logits for the last prompt token);
- grows tables as requests compute more tokens (`allocate`), refusing when the pool
  cannot supply the blocks, so the scheduler can preempt;
- registers blocks in the prefix cache as a step is planned to fill them
  (`register_blocks`: a later request of the same step can hit them, as in vLLM) and
  passes them on once computed (`cache_full_blocks`: offload write-through, state
  snapshots);
- frees a finished or preempted request's blocks tail first (`free`), which leaves its
  full blocks cached for its successor;
- forks: a child's table points at its parent's blocks (`fork`), and a shared block
  that is only partly full is copied before either side writes into it
  (copy-on-write).

The tables here serve the full-attention layers. A model with sliding-window layers
gives them a second table per request over the same pool (`window`, see
`sliding_window.py`); a hybrid linear-attention model keeps state snapshots
(`snapshots`, see `state_snapshots.py`). Either one narrows which cached prefixes
are usable.

Looking up a 142K-token agentic prompt must not cost 2,000 dictionary probes. The
previous call of the same session left its table behind as a **prefix hint**; the
cached part of that hint is a prefix (blocks are evicted tail first), so a binary
search over it finds the reusable prefix in O(log n) probes. Only blocks beyond the
hint are looked up one by one.
"""

from __future__ import annotations

import numpy as np

from labkit.engine.events import (
    BlocksAllocated, BlocksFreed, CacheHit, CopyOnWrite,
    EventBus, Forked,
)
from labkit.engine.kv import batch_play
from labkit.engine.kv.block_keys import TraceBlockKeys
from labkit.engine.kv.block_pool import NO_KEY, BlockPool
from labkit.engine.kv.block_table import EMPTY, NO_MATCH, BlockTable, PrefixHint, PrefixMatch

class KVManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 events: EventBus | None = None, rank: int = 0, *,
                 pool: BlockPool | None = None, window=None, snapshots=None,
                 on_cached=None) -> None:
        """`pool`: the rank's block pool, when its sliding-window tables and state
        snapshots share it (made before them, `engine/build.py`; its events bus is then
        the default); made here otherwise."""
        self.block_size = block_size
        self.events = events or (pool.events if pool is not None else EventBus())
        self.rank = rank
        self.pool = pool or BlockPool(num_blocks, enable_caching, self.events, rank)
        self.tables: dict[str, BlockTable] = {}
        # (rank, blocks, keys, now) on every block registered in the prefix cache: the
        # write-through into the node's offload tiers (engine/offload.py), if any
        self.on_cached = on_cached
        # hybrid models: linear-attention state snapshots (state_snapshots.py), if any
        self.snapshots = snapshots
        self._checkpoints: dict[str, int] = {}  # request -> block boundary to snapshot
        # sliding-window layers: their own tables (sliding_window.py), if any
        self.window = window
        # internal fragmentation, over finished calls: token slots their tables held
        # at the end vs tokens with KV in them
        self.slots_allocated = 0
        self.slots_used = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def set_time(self, t: float) -> None:
        self.pool.now = t

    def table(self, request_id: str) -> np.ndarray:
        table = self.tables.get(request_id)
        return table.view() if table else EMPTY

    def snapshot_boundary(self, request_id: str) -> int:
        """Hybrid models: the block boundary where req is to save a state snapshot
        on its way (a prefix seen the second time; 0 if none)."""
        return self._checkpoints.get(request_id, 0)

    def window_table(self, request_id: str, group: int = 0) -> np.ndarray:
        """The sliding-window layers' pages of each logical block (-1: not held)."""
        return self.window.table(request_id, group)

    def held_blocks(self, req) -> tuple[np.ndarray, int]:
        """The blocks holding req's KV and how many tokens they cover: its table while
        it runs; once freed, the full blocks of it still cached (its hint's prefix)."""
        table = self.tables.get(req.request_id)
        if table is not None:
            return table.view(), req.num_computed_tokens
        hint = req.prefix_hint
        if hint is None or hint.rank != self.rank or not len(hint.blocks):
            return EMPTY, 0
        alive = self.pool.unchanged(hint.blocks, hint.generations)
        n = len(alive) if alive.all() else int(np.argmin(alive))
        return hint.blocks[:n], n * self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---------------------------------------------------------------- lookup
    def lookup(self, req, computed_only: bool = False) -> PrefixMatch:
        """req's longest reusable prefix (its blocks are not referenced yet).

        Capped so at least one token is recomputed. A forked child (`forked_tokens`)
        also adopts its parent's last, partly filled block if it is still intact.
        `computed_only`: stop at blocks the step now planned is still to compute (what
        another rank may copy).
        """
        if not self.pool.enable_caching or req.keys is None:
            return NO_MATCH
        limit = min((req.num_tokens - 1) // self.block_size, req.keys.num_blocks)
        if limit <= 0:
            return NO_MATCH
        found = self._search_hint(req, limit)
        if len(found) < limit:
            found = self._walk(req.keys, found, limit, computed_only)
        m = len(found)
        if self.snapshots is not None:
            return self._with_state(req, found, m)
        if self.window is not None:  # no forked tail either: its window was never cached
            usable, pages = self.window.usable_prefix(req.keys, m)
            return PrefixMatch(found[:usable], usable * self.block_size, cached_blocks=m,
                               window_pages=pages)
        tokens = m * self.block_size
        if req.forked_tokens:
            tail_tokens = self._adoptable_tail(req, m)
            if tail_tokens:
                found = np.append(found, np.int32(req.prefix_hint.tail))
                return PrefixMatch(found, tokens + tail_tokens, forked=True)
        return PrefixMatch(found, tokens, forked=req.forked_tokens > 0 and tokens > 0)

    def _with_state(self, req, found: np.ndarray, m: int) -> PrefixMatch:
        """A hybrid model reuses cached KV only up to a boundary with a state snapshot
        (no forked tail: the state at a mid-block position was never saved)."""
        usable = self.snapshots.usable_blocks(req.keys, m)
        checkpoint = m if m > usable and self.snapshots.selective else 0
        return PrefixMatch(found[:usable], usable * self.block_size, cached_blocks=m,
                           checkpoint_blocks=checkpoint)

    def _adoptable_tail(self, req, num_full: int) -> int:
        """Tokens of the parent's partial tail block a forked child can adopt (or 0)."""
        hint = req.prefix_hint
        if hint is None or hint.rank != self.rank or hint.tail < 0:
            return 0
        if num_full != len(hint.blocks) or num_full != hint.num_tokens // self.block_size:
            return 0
        if not self.pool.unchanged(hint.tail, hint.tail_generation):
            return 0  # reused since the parent freed it
        shared = min(req.forked_tokens, hint.num_tokens, req.num_tokens - 1)
        return max(0, shared - num_full * self.block_size)

    def _walk(self, keys, found: np.ndarray, limit: int, computed_only: bool) -> np.ndarray:
        """`found` extended by the cached blocks of the keys after it, up to the first
        key not cached (or, `computed_only`, still pending). Keys are probed in chunks
        growing fourfold, so a long walk costs a few vectorised probes, a short one
        little more than the blocks it finds."""
        parts, m, chunk = [found], len(found), 16
        if isinstance(keys, TraceBlockKeys) and m < limit:  # keys made as they are probed
            blocks, known = self.pool.cached_trace_prefix(keys, m, limit, computed_only)
            if known:
                return np.concatenate((found, blocks)) if len(found) else blocks
            parts.append(blocks)  # the walk goes on by chunks from a key outside the array
            m += len(blocks)
        while m < limit:
            stop = min(limit, m + chunk)
            blocks = self.pool.cached_prefix(keys.keys(m, stop), computed_only)
            parts.append(blocks)
            if len(blocks) < stop - m:
                break
            m, chunk = stop, 4 * chunk
        return np.concatenate(parts) if len(parts) > 1 else found

    def _search_hint(self, req, limit: int) -> np.ndarray:
        hint = req.prefix_hint
        if hint is None or hint.rank != self.rank or len(hint.blocks) == 0:
            return EMPTY
        pool, keys = self.pool, req.keys
        blocks, gens = hint.blocks, hint.generations

        def still_ours(j: int) -> bool:
            return pool.still_holds(int(blocks[j]), int(gens[j]), keys.key(j))

        # Both conditions hold on a prefix of the hint and fail after it: blocks are
        # reused tail first, and chained keys never re-converge once they differ.
        lo, hi = 0, min(len(blocks), limit)
        if hi and still_ours(hi - 1):
            return blocks[:hi]  # the usual case: the whole hint is still cached
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if still_ours(mid - 1):
                lo = mid
            else:
                hi = mid - 1
        return blocks[:lo]

    # ------------------------------------------------------------ allocation
    def can_allocate(self, req, num_new_tokens: int, match: PrefixMatch = NO_MATCH,
                     copied: bool = False) -> bool:
        return self._blocks_to_take(req, num_new_tokens, match, copied) <= self.pool.num_free

    def _blocks_to_take(self, req, num_new_tokens: int, match: PrefixMatch,
                        copied: bool = False) -> int:
        table = self.tables.get(req.request_id)
        window = 0
        if self.window is not None:
            computed = match.num_tokens if table is None else req.num_computed_tokens
            window = self.window.pages_to_take(req.request_id, computed, num_new_tokens,
                                               match.window_pages, copied)
        return window + self._full_blocks_to_take(req, table, num_new_tokens, match)

    def _full_blocks_to_take(self, req, table, num_new_tokens: int, match) -> int:
        if table is None:
            have, computed = len(match.blocks), match.num_tokens
            need = self.pool.num_idle(match.blocks)  # hits on free blocks leave the pool
            tail = match.blocks[-1] if len(match.blocks) else -1
            if match.forked and computed % self.block_size and (
                    self.pool.ref_count[tail] > 0 or self.pool.block_key[tail] != NO_KEY):
                need += 1  # the adopted tail is not ours alone: writing into it copies it
        else:
            have, computed = table.n, req.num_computed_tokens
            need = 1 if self._needs_copy(table, computed) else 0
        return need + max(0, self.blocks_needed(computed + num_new_tokens) - have)

    def has_room(self, req, num_new_tokens: int) -> bool:
        """Does req's table cover num_new_tokens more already, in blocks that are its
        own? (The common case of `allocate`, a running request decoding: nothing to do.)"""
        table = self.tables.get(req.request_id)
        if table is None or self.window is not None:
            return False
        computed, size = req.num_computed_tokens, self.block_size
        if computed + num_new_tokens > table.n * size:
            return False
        # (`_needs_copy` inline: most calls write into a block they took themselves)
        idx = computed // size
        if computed % size == 0 or (idx >= table.num_shared and idx >= table.num_keyed):
            return True
        return not self._needs_copy(table, computed)

    def allocate(self, req, num_new_tokens: int, match: PrefixMatch = NO_MATCH,
                 copied: bool = False) -> bool:
        """Make req's table cover its computed tokens plus `num_new_tokens`.

        A request without a table starts from `match`, its reusable prefix (from
        `lookup`). `copied`: the new tokens' KV is copied in, not computed here (only
        matters to sliding-window layers). Returns False, changing nothing, if the
        pool is short.
        """
        if self.has_room(req, num_new_tokens):
            return True
        table = self.tables.get(req.request_id)
        if self._blocks_to_take(req, num_new_tokens, match, copied) > self.pool.num_free:
            return False
        if table is None:
            computed = match.num_tokens
            end = computed + (num_new_tokens if copied else 0)
            if self.snapshots is not None and req.keys is not None and end >= self.block_size:
                self.snapshots.resume(req.keys.key(end // self.block_size - 1),
                                      req.request_id, end)
            table = self._open_table(req, match)
            if copied:  # its prefix is not computed here: no state passes a checkpoint
                self._checkpoints.pop(req.request_id, None)
        else:
            computed = req.num_computed_tokens
            if self.window is not None:  # its freed pages count in the check above
                self.window.slide(req.request_id, computed)
        if self._needs_copy(table, computed):
            self._copy_on_write(req, table, computed)
        missing = self.blocks_needed(computed + num_new_tokens) - table.n
        if missing > 0:
            new = self.pool.allocate(missing)
            table.extend(new)
            if self.events.wants(BlocksAllocated):
                self.events.emit(BlocksAllocated(self.pool.now, self.rank, req.request_id, new))
        if self.window is not None:
            self.window.grow(req, computed, num_new_tokens, copied)
        return True

    def _open_table(self, req, match: PrefixMatch) -> BlockTable:
        table = BlockTable(self.blocks_needed(req.max_tokens))
        hit = match.blocks
        if self.snapshots is not None:
            self.snapshots.note_lookup(match.cached_blocks, len(hit), self.block_size)
            if match.checkpoint_blocks:
                self._checkpoints[req.request_id] = match.checkpoint_blocks
        if len(hit):
            self.pool.touch(hit)
            table.extend(hit)
            table.num_shared = len(hit)
            table.num_keyed = table.num_written = match.num_tokens // self.block_size
            if match.forked and self.events.wants(Forked):
                self.events.emit(Forked(self.pool.now, self.rank, req.parent_id or "",
                                        req.request_id, hit, match.num_tokens))
            elif self.events.wants(CacheHit):
                self.events.emit(CacheHit(self.pool.now, self.rank, req.request_id, hit))
        self.tables[req.request_id] = table
        if self.window is not None:
            self.window.open(req.request_id, len(table.blocks), len(hit), match.window_pages)
        return table

    def _needs_copy(self, table: BlockTable, computed: int) -> bool:
        """Writing at `computed` lands mid-block in a block that is not ours alone:
        shared with another table, or cached under a key (a sibling fork filled it)."""
        idx = computed // self.block_size
        if computed % self.block_size == 0 or idx >= table.n or (
                idx >= table.num_shared and idx >= table.num_keyed):
            return False  # (a block it took and has not keyed: `BlockTable.num_shared`)
        block = table.blocks[idx]
        return self.pool.ref_count[block] > 1 or self.pool.block_key[block] != NO_KEY

    def tail_is_shared(self, req) -> bool:
        """Would req's next write land in a block shared with another table?"""
        table = self.tables.get(req.request_id)
        if table is None:
            return False
        computed = req.num_computed_tokens
        return self._needs_copy(table, computed) or (
            self.window is not None and self.window.tail_is_shared(req.request_id, computed))

    def _copy_on_write(self, req, table: BlockTable, computed: int) -> None:
        idx = computed // self.block_size
        src = int(table.blocks[idx])
        dst = int(self.pool.allocate(1)[0])
        self.pool.free(np.array([src], dtype=np.int32))
        table.blocks[idx] = dst
        req.pending_copies.append((src, dst))
        if self.events.wants(CopyOnWrite):
            self.events.emit(CopyOnWrite(self.pool.now, self.rank, req.request_id, src, dst))

    # ------------------------------------------------ a fast-forwarded run's KV work
    # (done a batch at a time where that is exact: `batch_play.py`)
    def plays_in_batches(self) -> bool:
        return batch_play.plays_in_batches(self)

    def plan_batch(self, reqs, counts: np.ndarray, committed: int, tokens: np.ndarray):
        return batch_play.plan_batch(self, reqs, counts, committed, tokens)

    def play_batch(self, plan) -> None:
        batch_play.play_batch(self, plan)

    # ---------------------------------------------------------- prefix cache
    def register_blocks(self, req, num_tokens: int) -> None:
        """Register the blocks that will be full once req's first `num_tokens` tokens
        have KV — before the step computing them has run, as vLLM registers a
        request's full blocks when it allocates them. Another request admitted in the
        same step then shares them instead of computing them again (the step writes
        every new token's KV before any attention reads it)."""
        table = self.tables.get(req.request_id)
        if table is None or req.keys is None or not self.pool.enable_caching:
            return
        self._register(req, table, self._full_blocks(req, table, num_tokens), pending=True)

    def cache_full_blocks(self, req, starting: bool = False) -> None:
        """After a step: register the blocks req has now completely computed (unless
        registered ahead) and pass them on — write-through to the offload tiers, the
        state snapshot a hybrid model owes at a boundary it has passed. `starting`: as
        a step starts instead (a prefix copied in has arrived): the tiers order the
        writes of one time by it, a step's ends before the next step's starts."""
        filled = self._newly_full(req)
        if filled is None:
            return
        table, full = filled
        self._register(req, table, full)
        done = slice(table.num_written, full)
        self.pool.written(table.blocks[done])
        if self.window is not None:
            self.window.write_through(req.request_id, req.keys, table.num_written, full,
                                      starting)
        if self.on_cached is not None:
            self.on_cached(self.rank, table.blocks[done],
                           req.keys.keys(table.num_written, full), self.pool.now, starting)
        table.num_written = full
        boundary = self._checkpoints.get(req.request_id, 0)
        if boundary and full >= boundary:  # computed past a prefix seen before
            self.snapshots.save(req.keys.key(boundary - 1), "second_sight",
                                req.request_id, boundary * self.block_size)
            del self._checkpoints[req.request_id]

    def cache_full_blocks_of(self, reqs) -> None:
        """`cache_full_blocks` of each request, in order, after a step: as one
        registration where nothing sees the calls' order or grouping
        (`batch_play.plays_in_batches`; a step's ends make no other KV work between
        them). A saturated step has a dozen requests filling a block each."""
        if len(reqs) < 2 or not batch_play.plays_in_batches(self) or \
                not self.pool.enable_caching:
            for req in reqs:
                self.cache_full_blocks(req)
            return
        registered = [(table, full, req.keys.keys(table.num_keyed, max(full, table.num_keyed)))
                      for req, table, full in self._newly_full_of(reqs)]
        batch_play.register(self, registered)

    def _newly_full(self, req) -> tuple[BlockTable, int] | None:
        """(req's table, how many of its blocks are full) where some became full since
        the last registration; None where none did (most steps of a decode)."""
        found = self._newly_full_of((req,))
        return found[0][1:] if found else None

    def _newly_full_of(self, reqs) -> list:
        """(request, its table, how many of its blocks are full) for each of reqs that
        has blocks newly full (`_newly_full`), in order."""
        found = []
        if not self.pool.enable_caching:
            return found
        tables, size = self.tables, self.block_size  # (a step of hundreds of requests)
        for req in reqs:
            table = tables.get(req.request_id)
            if table is None or req.keys is None or \
                    req.num_computed_tokens // size <= table.num_written:
                continue
            full = self._full_blocks(req, table, req.num_computed_tokens)
            if full > table.num_written:
                found.append((req, table, full))
        return found

    def _full_blocks(self, req, table: BlockTable, num_tokens: int) -> int:
        return min(num_tokens // self.block_size, req.keys.num_blocks, table.n)

    def _register(self, req, table: BlockTable, full: int, pending: bool = False) -> None:
        if full > table.num_keyed:
            self.pool.cache_blocks(table.blocks[table.num_keyed : full],
                                   req.keys.keys(table.num_keyed, full), req.request_id,
                                   pending)
            table.num_keyed = full
        if self.window is not None:
            self.window.register(req.request_id, req.keys, full)

    # ------------------------------------------------------------- release
    def free(self, req) -> PrefixHint | None:
        """Release req's blocks, tail first. Returns a hint to what it leaves cached."""
        table = self.tables.pop(req.request_id, None)
        if table is None:
            return None
        blocks = table.view()
        computed = req.num_computed_tokens
        hint = PrefixHint(self.rank, *self.pool.keyed_prefix(blocks), num_tokens=computed)
        tail_index = computed // self.block_size
        if computed % self.block_size and tail_index < table.n:
            hint.tail = int(blocks[tail_index])
            hint.tail_generation = int(self.pool.generation[hint.tail])
        if req.finish_s is not None:
            self.slots_allocated += len(blocks) * self.block_size
            self.slots_used += computed
        self.pool.free(blocks[::-1])
        if self.window is not None:
            self.window.free(req.request_id)
        if self.events.wants(BlocksFreed):
            self.events.emit(BlocksFreed(self.pool.now, self.rank, req.request_id, blocks.copy()))
        if self.snapshots is not None:
            self._checkpoints.pop(req.request_id, None)
            # the state after the last full block (its KV may be cached by another
            # table: a recomputed prefix does not re-key blocks already cached)
            boundary = min(computed // self.block_size, req.keys.num_blocks) \
                if req.keys is not None else 0
            if self.snapshots.interval and req.finish_s is not None and boundary:
                self.snapshots.save(req.keys.key(boundary - 1), "call_end",
                                    req.request_id, boundary * self.block_size)
        return hint

    def fork(self, parent, child, num_tokens: int) -> None:
        """Give `child` a table sharing a *running* parent's first num_tokens of KV.

        No copy is made: both tables point at the same blocks (ref counts go up). The
        first one to write into a shared, partly filled block copies it first.
        """
        parent_table = self.tables[parent.request_id]
        if num_tokens > parent.num_computed_tokens:
            raise ValueError(f"cannot fork {num_tokens} tokens: parent {parent.request_id} "
                             f"has {parent.num_computed_tokens} computed")
        shared = parent_table.view()[: self.blocks_needed(num_tokens)]
        table = BlockTable(self.blocks_needed(child.max_tokens))
        if self.window is not None:  # first: it may refuse
            self.window.fork(parent.request_id, child.request_id, num_tokens,
                             len(table.blocks))
        self.pool.touch(shared)
        table.extend(shared)
        table.num_shared = len(shared)
        parent_table.num_shared = max(parent_table.num_shared, len(shared))
        table.num_keyed = table.num_written = min(parent_table.num_written,
                                                  num_tokens // self.block_size)
        self.tables[child.request_id] = table
        child.num_computed_tokens = num_tokens
        if self.events.wants(Forked):
            self.events.emit(Forked(self.pool.now, self.rank, parent.request_id,
                                    child.request_id, shared.copy(), num_tokens))
