"""The block pool: one rank's physical KV blocks and the prefix cache over them.

KV memory is cut into fixed-size blocks (`block_size` tokens each). Every block has

- a **ref count**: how many requests' block tables point at it (forks and prefix hits
  share blocks, so it can exceed one);
- optionally a **key**: once a block is full, the key names its content *and its whole
  prefix* (a chained hash). Equal keys mean equal KV, so a later request whose prompt
  produces the same key can reuse the block instead of recomputing it.

A block with ref count 0 is free. It stays in the cache (keeps its key) until the
`FreeBlockQueue` hands it out again, least recently freed first; only then is its key
dropped ("eviction"). Requests free their blocks tail first, so a prefix's last blocks
are evicted before its first ones and what remains cached is always a prefix — which
is what makes a binary search for the longest cached prefix correct.

All per-block state lives in numpy arrays so that touching the 2,000+ blocks of a
long agentic prompt is one vectorised operation, not a Python loop. The arrays cover
the blocks handed out so far (growing by doubling, `free_queue.grown`): a block never
used has ref count 0, no key and generation 0, which is what an absent entry means.
"""

from __future__ import annotations

import numpy as np

from labkit.engine.events import BlocksCached, BlocksEvicted, EventBus
from labkit.engine.kv.free_queue import EAGER_BLOCKS, FreeBlockQueue, grown
from labkit.engine.kv.key_index import KeyIndex

NO_KEY = -1


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 events: EventBus | None = None, rank: int = 0) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.events = events or EventBus()
        self.rank = rank
        size = min(num_blocks, EAGER_BLOCKS)
        self.ref_count = np.zeros(size, dtype=np.int32)
        self.block_key = np.full(size, NO_KEY, dtype=np.int64)
        # Bumped each time a block is handed out: a remembered (block, generation) pair
        # is still the same KV exactly when the generation has not moved.
        self.generation = np.zeros(size, dtype=np.int64)
        # Registered by a step that has not run yet (same-step prefix hits): hittable
        # on this rank, not yet KV another rank could copy.
        self.pending = np.zeros(size, dtype=bool)
        self._cached = KeyIndex()  # key -> physical block
        self._free = FreeBlockQueue(num_blocks)
        self.now = 0.0  # time stamp for events, set by the owner

    # ------------------------------------------------------------ accounting
    @property
    def num_free(self) -> int:
        """Blocks with ref count 0, cached or not: what an allocation can take."""
        return self._free.num_free

    @property
    def num_used(self) -> int:
        return self.num_blocks - self._free.num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        """Fraction of blocks in use (vLLM's kv_cache_usage)."""
        return self.num_used / self.num_blocks

    def free_order(self) -> np.ndarray:
        return self._free.order()

    # ------------------------------------------------------------ allocation
    def allocate(self, n: int) -> np.ndarray:
        """n fresh blocks (ref count 1), evicting the least recently freed ones."""
        blocks = self._free.popleft(n)
        if self._free.fresh > len(self.ref_count):  # first use of blocks past the arrays
            need, limit = self._free.fresh, self.num_blocks
            self.ref_count = grown(self.ref_count, need, limit, 0)
            self.block_key = grown(self.block_key, need, limit, NO_KEY)
            self.generation = grown(self.generation, need, limit, 0)
            self.pending = grown(self.pending, need, limit, False)
        self._evict(blocks)
        self.ref_count[blocks] = 1
        self.generation[blocks] += 1
        return blocks

    def _evict(self, blocks: np.ndarray) -> None:
        keys = self.block_key[blocks]
        had_key = keys != NO_KEY
        if not had_key.any():
            return
        evicted = blocks[had_key]
        self._cached.drop(keys[had_key])
        self.block_key[evicted] = NO_KEY
        if self.events.wants(BlocksEvicted):
            self.events.emit(BlocksEvicted(self.now, self.rank, evicted))

    def next_to_evict(self, n: int) -> np.ndarray:
        """The blocks the next allocations of n blocks in all would take (no touch or
        free between them), least recently freed first; nothing changes."""
        return self._free.peek(n)

    def would_take_any(self, n: int, blocks: np.ndarray) -> bool:
        """Would the next allocations of n blocks in all take one of `blocks` (blocks
        handed out before)? One mark per block to be taken, then a gather: cheaper
        than a set intersection."""
        taken = self._free.peek(n)
        if len(taken) == 0 or len(blocks) == 0:
            return False
        # (never used blocks come first: [fresh, fresh + n) at most, past the arrays)
        marked = np.zeros(len(self.ref_count) + n, dtype=bool)
        marked[taken] = True
        return bool(marked[blocks].any())

    def touch(self, blocks: np.ndarray) -> None:
        """Take a reference to blocks found in the cache (a prefix hit or a fork)."""
        if len(blocks) == 0:
            return
        idle = blocks[self.ref_count[blocks] == 0]
        if len(idle):
            self._free.remove(idle)
        self.ref_count[blocks] += 1

    def free(self, blocks: np.ndarray) -> None:
        """Drop one reference to each block; give them in the order they should be
        reused (a request passes its block table reversed, tail first)."""
        if len(blocks) == 0:
            return
        if (self.ref_count[blocks] <= 0).any():
            raise RuntimeError(f"rank {self.rank}: freeing a block that is not in use")
        self.ref_count[blocks] -= 1
        self._free.append(blocks[self.ref_count[blocks] == 0])

    # ---------------------------------------------------------- prefix cache
    def cache_blocks(self, blocks: np.ndarray, keys: np.ndarray, request_id: str = "",
                     pending: bool = False) -> None:
        """Full blocks get their keys and become hittable (`pending`: their KV is
        computed by the step now being planned; `written` clears the mark).

        If another block already holds a key (two requests computed the same content
        at once), the newcomer stays unkeyed and is reused as an ordinary block. So a
        block has a key exactly when it is the one the cache hands out for that key.
        """
        if not self.enable_caching or len(blocks) == 0:
            return
        if (self.block_key[blocks] != NO_KEY).any():
            raise RuntimeError(f"rank {self.rank}: {request_id} would re-key a cached block "
                               f"(writing into a registered block needs a copy first)")
        # The first block to claim a key keeps it: a key that is held already (here, or
        # earlier in this call) stays with its holder, so a block got its key exactly
        # where it is its key's holder (no other key names these blocks, checked above).
        blocks, keys = np.asarray(blocks), np.asarray(keys, dtype=np.int64)
        holders = self._cached.claim(keys, blocks)
        if holders is None:  # the usual case: all new and distinct
            fresh, fresh_keys = blocks, keys
        else:
            claimed = holders == blocks
            fresh, fresh_keys = blocks[claimed], keys[claimed]
        if len(fresh):
            self.block_key[fresh] = fresh_keys
            self.pending[fresh] = pending
            if self.events.wants(BlocksCached):
                self.events.emit(BlocksCached(self.now, self.rank, request_id,
                                              np.array(fresh, dtype=np.int32),
                                              np.array(fresh_keys, dtype=np.int64)))

    def cached_none(self, keys: list) -> bool:
        """Is none of these keys cached?"""
        return self._cached.none_of(keys)

    def written(self, blocks: np.ndarray) -> None:
        """The step computing these blocks has run: their KV exists."""
        self.pending[blocks] = False

    def cached_block(self, key: int) -> int:
        """The physical block holding `key`, or -1."""
        return self._cached.get(key)

    def cached_blocks(self, keys: np.ndarray) -> np.ndarray:
        """The physical block holding each key, or -1 (one gather for trace keys)."""
        return self._cached.get_many(keys)

    def unchanged(self, blocks, generations):
        """Elementwise: is block[i] still the one handed out at generations[i]? False
        for a block this pool never handed out (one another pool's hint names)."""
        blocks, generations = np.asarray(blocks), np.asarray(generations)
        known = blocks < len(self.generation)
        same = np.zeros(blocks.shape, dtype=bool)
        same[known] = self.generation[blocks[known]] == generations[known]
        return same

    def holds(self, blocks: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """Elementwise: does block[i] still hold keys[i]?"""
        return self.block_key[blocks] == keys

    def keyed_prefix_length(self, blocks: np.ndarray) -> int:
        """How many leading blocks hold a cache key (only registered blocks do)."""
        keyed = self.block_key[blocks] != NO_KEY
        return len(blocks) if keyed.all() else int(np.argmin(keyed))
