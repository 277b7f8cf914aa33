"""Linear-attention state snapshots: prefix caching for hybrid models.

A hybrid model (Kimi-Linear: 3 linear-attention layers for 1 full-attention layer)
keeps two kinds of context. Full-attention layers keep per-token KV in paged blocks,
reusable block by block as usual. Linear-attention layers keep one fixed-size
*state* per sequence that summarises every token so far — it is overwritten at each
step, so a later call can reuse a prefix of n tokens only if the state after exactly
those n tokens was saved somewhere. A prefix hit therefore needs both: the KV blocks
of the prefix *and* a snapshot of the state at its end. Without the snapshot the call
recomputes from the last boundary that has one.

Snapshots live in the same pool as KV blocks, in pages of the same size (vLLM's
hybrid allocator: one page size for every layer kind): a snapshot takes
`pages_per_snapshot` pool blocks, registered under keys derived from the boundary's
block key and immediately released — so they are evicted, LRU, like cached KV. Which
boundaries get a snapshot (`linear_state_retention`):

- **interval**: at the end of every call, the state at its last full block — what the
  session's next call (which re-sends this context) starts from;
- **selective**: a call whose KV blocks are cached further than any snapshot has met a
  prefix for the second time (a fork point, a retried call): it recomputes from the
  last snapshot and saves one at the end of that cached prefix on its way, so the next
  call sharing it hits in full (SGLang's approach for Mamba radix caching);
- **both** (default), or **none**: KV blocks alone never give a hit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from labkit.engine.kv.block_keys import SNAPSHOT_NAMESPACE, derived_keys

RETENTION = ("both", "interval", "selective", "none")


@dataclass(slots=True)
class SnapshotStats:
    saved_at_call_end: int = 0
    saved_on_second_sight: int = 0
    skipped_no_space: int = 0  # the pool had no free page for a snapshot
    hits: int = 0  # lookups whose prefix ends at a snapshot
    tokens_recomputed: int = 0  # cached KV tokens a lookup gave up for lack of a state


def snapshot_keys(boundary_key: int, pages: int) -> np.ndarray:
    """The pool keys of the snapshot taken after the block named boundary_key."""
    return derived_keys(SNAPSHOT_NAMESPACE, boundary_key, pages)


def snapshot_held(pool, boundary_key: int, pages: int) -> bool:
    """Is that snapshot still in the pool (all its pages cached)? Also asked by whoever
    tracks the snapshots a data plane was told of (`hybrid_kv.SnapshotCommands`)."""
    return all(pool.cached_block(int(k)) >= 0 for k in snapshot_keys(boundary_key, pages))


class StateSnapshots:
    def __init__(self, pool, pages_per_snapshot: int, retention: str = "both",
                 on_saved=None, on_restored=None) -> None:
        self.pool = pool
        # (boundary key, request id, tokens) of every new snapshot, and of every snapshot a
        # request resumes from: the compute plane copies the state (compute/linear_state.py)
        self.on_saved = on_saved
        self.on_restored = on_restored
        self.pages = max(1, int(pages_per_snapshot))
        self.interval = retention in ("both", "interval")
        self.selective = retention in ("both", "selective")
        self.stats = SnapshotStats()

    def _keys(self, boundary_key: int) -> np.ndarray:
        return snapshot_keys(boundary_key, self.pages)

    def has(self, boundary_key: int) -> bool:
        return snapshot_held(self.pool, boundary_key, self.pages)

    # --------------------------------------------------------------- lookup
    def usable_blocks(self, keys, num_blocks: int) -> int:
        """Of a prefix of `num_blocks` cached KV blocks (named by `keys`), how many can
        be reused: up to the last boundary with a snapshot (0 if none)."""
        for j in range(num_blocks, 0, -1):
            if self.has(keys.key(j - 1)):
                return j
        return 0

    def note_lookup(self, cached_blocks: int, usable: int, block_size: int) -> None:
        if usable:
            self.stats.hits += 1
        self.stats.tokens_recomputed += (cached_blocks - usable) * block_size

    def resume(self, boundary_key: int, request_id: str, position: int) -> None:
        """A request starts from `position` tokens of cached (or arriving) prefix, the
        end of the block named boundary_key: it copies the snapshot there into its own
        state — now, before its new blocks may evict the snapshot's pages. (A prefix
        fetched from another rank brings its state along: nothing to copy here.)"""
        if self.on_restored is not None and self.has(boundary_key):
            self.on_restored(boundary_key, request_id, position)

    # ----------------------------------------------------------------- save
    def save(self, boundary_key: int, reason: str, request_id: str = "",
             position: int = 0) -> bool:
        """Store the state `request_id` had after `position` tokens, the end of the
        block named boundary_key; False when the pool has no room for it (it never
        evicts a block in use)."""
        keys = self._keys(boundary_key)
        held = np.array([self.pool.cached_block(int(k)) for k in keys], dtype=np.int32)
        if (held >= 0).all():  # already there: refresh it (most recently used)
            self.pool.touch(held)
            self.pool.free(held)
            return True
        if self.pool.num_free < self.pages:
            self.stats.skipped_no_space += 1
            return False
        keys = keys[held < 0]  # pages of a partly evicted snapshot that are still there stay
        pages = self.pool.allocate(len(keys))
        self.pool.cache_blocks(pages, keys, "linear-state")
        self.pool.free(pages)
        if self.on_saved is not None:
            self.on_saved(boundary_key, request_id, position)
        if reason == "call_end":
            self.stats.saved_at_call_end += 1
        else:
            self.stats.saved_on_second_sight += 1
        return True
