"""Sliding-window layers: a second block table per request, freed as the window moves.

A sliding-window attention (SWA) layer (gpt-oss, Gemma, Mistral) lets a query at
position p read only positions p-W+1 .. p. Its KV for older tokens is never read
again, so a request needs only the last W tokens of it — however long its context.
vLLM's hybrid allocator serves such a model with one block table per *KV-cache
group* over one shared pool; we do the same with two groups:

- the full-attention layers keep the request's ordinary table (`KVManager.tables`);
- the sliding-window layers keep a `WindowTable` here: for each logical block the
  pool pages holding that block's KV in the SWA layers, or -1 once the block has left
  the window. Before every step the table *slides*: blocks wholly before
  `computed - W + 1` go back to the pool, where anyone can reuse them.

**One page size.** The pool's block (a page) holds `block_size` tokens of the
full-attention layers. The SWA layers of one logical block take
`pages_per_block = ceil(swa_layers / full_layers)` pages (gpt-oss: 18 and 18 -> 1),
so a model with fewer SWA than full layers wastes part of its SWA pages — reported
by `capacity()`.

**Prefix caching.** A full SWA page is registered under a key derived from its
block's key (a namespace of its own). A cached prefix of m blocks is usable only if
the SWA pages of its last `ceil((W-1)/block_size)` blocks are cached too: the next
token attends them. The pages of earlier blocks may be long gone — that is the
point. Freed window pages keep their keys until reused, so a session's next call,
which re-sends this call's context, finds the window its previous call left at its
end. Under memory pressure a cached prefix loses its tail first; its hit then needs
the window pages of an earlier point, freed as the window passed it — which is why
SWA models lose more of their hits to eviction than full-attention ones.
"""

from __future__ import annotations

import numpy as np

from labkit.engine.events import EventBus, WindowSlid
from labkit.engine.kv.block_keys import WINDOW_NAMESPACE, derived_keys
from labkit.engine.kv.block_pool import NO_KEY, BlockPool
from labkit.errors import ConfigError


def check_sliding_window(model, layout, config) -> None:
    """What a sliding-window model cannot be combined with (yet), before anything runs.

    Token-sharded KV (DCP, PCP) and layer-sharded KV (KVPP) would need per-shard
    windows. (Offload tiers keep window pages too, and a loaded prefix brings its
    window along. A session's KV fetched from another DP rank,
    `session_kv_migration="fetch"`, is costed by its full-attention bytes; the compute
    plane copies the window's pages at its end along. P/D sends the window at the end
    of the prompt.)
    """
    if not model.sliding_window_layers:
        return
    where = f"{model.name} has sliding-window layers"
    for name, size in (("dcp", layout.dcp), ("pcp", layout.pcp), ("kvpp", layout.kvpp)):
        if size > 1:
            raise ConfigError(f"{where}: layout {layout.text!r} uses {name}{size}, which labkit "
                              f"does not model for sliding-window KV; use tp, pp, ep or dp")
    if model.linear_layers:
        raise ConfigError(f"{where} and linear-attention layers: not supported together")


class WindowTable:
    """One request's SWA pages: `pages[i, j]` is page j of logical block i, -1 if not
    held. Blocks before `first_live` are all -1."""

    __slots__ = ("pages", "n", "first_live", "num_keyed")

    def __init__(self, capacity: int, pages_per_block: int) -> None:
        self.pages = np.full((max(capacity, 1), pages_per_block), -1, dtype=np.int32)
        self.n = 0
        self.first_live = 0
        self.num_keyed = 0  # leading blocks already registered (or gone)

    def extend(self, new: np.ndarray) -> None:
        """Append logical blocks (rows of pages; -1 rows for blocks not held)."""
        end = self.n + len(new)
        if end > len(self.pages):
            grown = np.full((max(end, 2 * len(self.pages)), self.pages.shape[1]), -1,
                            dtype=np.int32)
            grown[: self.n] = self.pages[: self.n]
            self.pages = grown
        self.pages[self.n : end] = new
        self.n = end

    def live(self) -> np.ndarray:
        """The pages held, oldest block first."""
        return self.pages[self.first_live : self.n].ravel()


class SlidingWindow:
    """The SWA group of one rank's KV manager (see the module docstring)."""

    def __init__(self, pool: BlockPool, block_size: int, window: int, pages_per_block: int,
                 events: EventBus | None = None, rank: int = 0, on_cached=None) -> None:
        if window < 1 or pages_per_block < 1:
            raise ValueError(f"sliding window {window} / pages per block {pages_per_block} "
                             "must be >= 1")
        self.pool = pool
        self.block_size = block_size
        self.window = window
        self.pages_per_block = pages_per_block
        self.events = events or EventBus()
        self.rank = rank
        # trailing blocks whose SWA pages a prefix hit needs (vLLM: cdiv(W - 1, B))
        self.hit_blocks = -(-(window - 1) // block_size)
        self.tables: dict[str, WindowTable] = {}
        self.pages_slid = 0  # pages freed early, as they left a window
        # (rank, pages, keys, now) on every page registered: the write-through into the
        # node's offload tiers (engine/offload.py), if any
        self.on_cached = on_cached

    def first_needed(self, computed: int) -> int:
        """First logical block a step starting at token `computed` still reads."""
        return max(0, computed - self.window + 1) // self.block_size

    def page_keys(self, block_key: int) -> np.ndarray:
        return derived_keys(WINDOW_NAMESPACE, block_key, self.pages_per_block)

    def _cached_pages(self, block_key: int) -> np.ndarray | None:
        pages = np.array([self.pool.cached_block(int(k)) for k in self.page_keys(block_key)],
                         dtype=np.int32)
        return pages if (pages >= 0).all() else None

    # ---------------------------------------------------------------- lookup
    def usable_prefix(self, keys, num_blocks: int) -> tuple[int, np.ndarray]:
        """Of `num_blocks` cached full-attention blocks, the longest prefix m whose
        window is cached too, and the pages of its blocks m-hit_blocks .. m-1.

        Scans from the end for a run of `hit_blocks` consecutive cached blocks (a run
        that reaches block 0 also serves: the window starts before the sequence).
        """
        need = self.hit_blocks
        if need == 0 or num_blocks == 0:
            return num_blocks, np.empty((0, self.pages_per_block), dtype=np.int32)
        run: list[np.ndarray] = []
        for j in range(num_blocks - 1, -1, -1):
            pages = self._cached_pages(keys.key(j))
            if pages is None:
                run = []
                continue
            run.append(pages)
            if len(run) == need:
                return j + need, np.array(run[::-1], dtype=np.int32)
        return len(run), np.array(run[::-1], dtype=np.int32).reshape(-1, self.pages_per_block)

    # ------------------------------------------------------------ allocation
    def pages_to_take(self, request_id: str, computed: int, num_new: int,
                      hit_pages: np.ndarray | None = None, copied: bool = False) -> int:
        """Fresh pages `grow` would take, counting pages it frees by sliding first."""
        table = self.tables.get(request_id)
        end = -(-(computed + num_new) // self.block_size)
        if table is None:
            held = hit_pages if hit_pages is not None else np.empty(0, dtype=np.int32)
            need = self.pool.num_idle(held.ravel())
            start = self._first_new(computed // self.block_size, computed + num_new, copied)
            return need + max(0, end - start) * self.pages_per_block
        slide_to = computed + num_new if copied else computed
        released = self._releasable(table, slide_to)
        copy = self.pages_per_block if self._needs_copy(table, computed) else 0
        start = self._first_new(table.n, computed + num_new, copied)
        return copy + max(0, end - start) * self.pages_per_block - released

    def _first_new(self, num_blocks: int, end_tokens: int, copied: bool) -> int:
        """First new logical block that gets pages: all of them when the tokens are
        computed here (the chunk's queries read them); only the window at their end
        when their KV arrives ready-made (copied from another rank)."""
        return max(num_blocks, self.first_needed(end_tokens)) if copied else num_blocks

    def _releasable(self, table: WindowTable, computed: int) -> int:
        """Pages sliding to `computed` would return to the free pool."""
        stop = min(self.first_needed(computed), table.n)
        if stop <= table.first_live:
            return 0
        gone = table.pages[table.first_live : stop].ravel()
        return int((self.pool.ref_count[gone] == 1).sum())

    def open(self, request_id: str, capacity: int, num_blocks: int,
             hit_pages: np.ndarray | None) -> WindowTable:
        """A table for a request starting from a prefix of `num_blocks` blocks whose
        last len(hit_pages) blocks' pages are cached (referenced here)."""
        table = WindowTable(capacity, self.pages_per_block)
        held = 0 if hit_pages is None else len(hit_pages)
        if num_blocks:
            rows = np.full((num_blocks, self.pages_per_block), -1, dtype=np.int32)
            if held:
                self.pool.touch(hit_pages.ravel())
                rows[num_blocks - held :] = hit_pages
            table.extend(rows)
        table.first_live = num_blocks - held
        table.num_keyed = num_blocks  # the hit pages are cached already
        self.tables[request_id] = table
        return table

    def grow(self, req, computed: int, num_new: int, copied: bool = False) -> None:
        """Slide to `computed`, copy a shared partial block, then add the pages that
        tokens up to computed + num_new need (the caller checked `pages_to_take`).
        `copied`: those tokens' KV arrives from elsewhere, and only the window at their
        end is kept."""
        table = self.tables[req.request_id]
        self.slide(req.request_id, computed + num_new if copied else computed)
        if self._needs_copy(table, computed):
            idx = computed // self.block_size
            src = table.pages[idx].copy()
            dst = self.pool.allocate(self.pages_per_block)
            self.pool.free(src)
            table.pages[idx] = dst
            req.pending_copies.extend(zip(src.tolist(), dst.tolist()))
        end = -(-(computed + num_new) // self.block_size)
        if end <= table.n:
            return
        start = self._first_new(table.n, computed + num_new, copied)
        rows = np.full((end - table.n, self.pages_per_block), -1, dtype=np.int32)
        rows[start - table.n :] = self.pool.allocate(
            (end - start) * self.pages_per_block).reshape(end - start, self.pages_per_block)
        if table.first_live == table.n:  # nothing held before: skip the gap
            table.first_live = table.num_keyed = max(table.num_keyed, start)
        table.extend(rows)

    def slide(self, request_id: str, computed: int) -> None:
        """Free the pages of blocks no query from `computed` on will read."""
        table = self.tables[request_id]
        stop = min(self.first_needed(computed), table.n)
        if stop <= table.first_live:
            return
        gone = table.pages[table.first_live : stop].ravel().copy()
        table.pages[table.first_live : stop] = -1
        table.first_live = stop
        table.num_keyed = max(table.num_keyed, stop)
        # Plain LRU, on purpose: queued ahead of other free blocks instead, they cost
        # more hits than they save (NOTES.md): when a cached prefix loses its tail to
        # eviction, its hit falls back to a point whose window was freed here.
        self.pool.free(gone)
        self.pages_slid += len(gone)
        if self.events.wants(WindowSlid):
            self.events.emit(WindowSlid(self.pool.now, self.rank, request_id, gone))

    def _needs_copy(self, table: WindowTable, computed: int) -> bool:
        idx = computed // self.block_size
        if computed % self.block_size == 0 or idx >= table.n or idx < table.first_live:
            return False
        pages = table.pages[idx]
        return bool((self.pool.ref_count[pages] > 1).any()
                    or (self.pool.block_key[pages] != NO_KEY).any())

    def tail_is_shared(self, request_id: str, computed: int) -> bool:
        table = self.tables.get(request_id)
        return table is not None and self._needs_copy(table, computed)

    # ---------------------------------------------------------- prefix cache
    def register(self, request_id: str, keys, full: int) -> None:
        """Register the SWA pages of blocks up to `full` not registered yet (blocks
        that already left the window have nothing to register)."""
        table = self.tables.get(request_id)
        if table is None or full <= table.num_keyed:
            return
        start = max(table.num_keyed, table.first_live)
        if start < full:
            self.pool.cache_blocks(table.pages[start:full].ravel(),
                                   self._page_keys_of(keys, start, full), request_id)
        table.num_keyed = full

    def write_through(self, request_id: str, keys, start: int, full: int,
                      starting: bool = False) -> None:
        """Pass the SWA pages of blocks start..full-1, now computed, to the offload
        tiers (those still held); `starting` as `KVManager.cache_full_blocks`'s."""
        table = self.tables.get(request_id)
        if self.on_cached is None or table is None:
            return
        start = max(start, table.first_live)
        if start < full:
            self.on_cached(self.rank, table.pages[start:full].ravel(),
                           self._page_keys_of(keys, start, full), self.pool.now, starting)

    def _page_keys_of(self, keys, start: int, stop: int) -> np.ndarray:
        return np.concatenate([self.page_keys(keys.key(j)) for j in range(start, stop)])

    # ------------------------------------------------------------- release
    def free(self, request_id: str) -> None:
        table = self.tables.pop(request_id, None)
        if table is not None:
            self.pool.free(table.live()[::-1])

    def fork(self, parent_id: str, child_id: str, num_tokens: int, capacity: int) -> None:
        """The child shares the parent's window pages up to `num_tokens`; refused when
        the parent's window has already moved past what the child would read."""
        parent = self.tables[parent_id]
        first, end = self.first_needed(num_tokens), -(-num_tokens // self.block_size)
        if first < parent.first_live:
            raise ValueError(f"cannot fork {child_id} at token {num_tokens}: {parent_id}'s "
                             f"sliding window has moved past it (first block held "
                             f"{parent.first_live}, needed {first})")
        table = WindowTable(capacity, self.pages_per_block)
        rows = parent.pages[:end].copy()
        rows[:first] = -1
        self.pool.touch(rows[first:end].ravel())
        table.extend(rows)
        table.first_live = first
        table.num_keyed = min(parent.num_keyed, num_tokens // self.block_size)
        self.tables[child_id] = table

    def pages_of(self, request_id: str, first: int, end: int) -> np.ndarray:
        """The pages request_id holds for logical blocks first .. end-1, in order."""
        pages = self.tables[request_id].pages[first:end].ravel()
        if (pages < 0).any():
            raise RuntimeError(f"{request_id} holds no window pages for some of blocks "
                               f"{first}..{end - 1}")
        return pages

    def table(self, request_id: str, group: int = 0) -> np.ndarray:
        """Page `group` of each logical block (-1 where not held): what a layer of the
        group indexes its KV by."""
        table = self.tables.get(request_id)
        if table is None:
            return np.empty(0, dtype=np.int32)
        return table.pages[: table.n, group]
