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

All per-block state lives in numpy arrays, and each operation that changes it —
allocate, free, touch, register keys — is one compiled loop (`numba`) over its blocks,
composed of the free queue's and the key index's own loops: a long agentic prompt's
2,000+ blocks cost no Python per block, and a decode's one block no dozen numpy calls.
The arrays cover the blocks handed out so far (growing by doubling, `free_queue.grown`):
a block never used has ref count 0, no key and generation 0, which is what an absent
entry means.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from labkit.engine.events import BlocksCached, BlocksEvicted, EventBus
from labkit.engine.kv.block_keys import NO_KEYS
from labkit.engine.kv.free_queue import (EAGER_BLOCKS, FreeBlockQueue, grown, link_one,
                                         pop_head, unlink_one, walk_head)
from labkit.engine.kv.key_index import KeyIndex, claim_slot, clear_slot

NO_KEY = -1


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 events: EventBus | None = None, rank: int = 0) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        load_loops()
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
        queue = self._free
        need = queue.make_room(n)
        if need > len(self.ref_count):  # first use of blocks past the arrays
            limit = self.num_blocks
            self.ref_count = grown(self.ref_count, need, limit, 0)
            self.block_key = grown(self.block_key, need, limit, NO_KEY)
            self.generation = grown(self.generation, need, limit, 0)
            self.pending = grown(self.pending, need, limit, False)
        blocks, *evicted = _take(queue.prev, queue.next, queue.state, self.num_blocks, n,
                                 self.ref_count, self.block_key, self.generation,
                                 self._cached.slot)
        self._evicted(*evicted)
        return blocks

    def _evict(self, blocks: np.ndarray) -> None:
        """Drop the keys of these blocks (tests knock cached pages out this way)."""
        self._evicted(*_drop_keys(self.block_key, self._cached.slot, blocks))

    def _evicted(self, blocks: np.ndarray, keys: np.ndarray, direct: int) -> None:
        if len(blocks):
            self._cached.cleared(keys, direct)
            if self.events.wants(BlocksEvicted):
                self.events.emit(BlocksEvicted(self.now, self.rank, blocks))

    def next_to_evict(self, n: int) -> np.ndarray:
        """The blocks the next allocations of n blocks in all would take (no touch or
        free between them), least recently freed first; nothing changes."""
        return self._free.peek(n)

    def would_take_any(self, n: int, blocks: np.ndarray) -> bool:
        """Would the next allocations of n blocks in all take one of `blocks` (blocks
        handed out before)?"""
        queue = self._free
        return _takes_any(queue.next, queue.state, self.num_blocks, min(n, queue.num_free),
                          len(self.ref_count), blocks)

    def num_idle(self, blocks: np.ndarray) -> int:
        """How many of these blocks are free (ref count 0): what a hit on them takes
        out of the free pool."""
        return _idle(self.ref_count, np.asarray(blocks))

    def touch(self, blocks: np.ndarray) -> None:
        """Take a reference to blocks found in the cache (a prefix hit or a fork)."""
        queue = self._free
        _hold(queue.prev, queue.next, queue.state, self.ref_count, np.asarray(blocks))

    def free(self, blocks: np.ndarray) -> None:
        """Drop one reference to each block; give them in the order they should be
        reused (a request passes its block table reversed, tail first)."""
        queue = self._free
        if not _release(queue.prev, queue.next, queue.state, self.ref_count,
                        np.asarray(blocks)):
            raise RuntimeError(f"rank {self.rank}: freeing a block that is not in use")

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
        # The first block to claim a key keeps it: a key that is held already (here, or
        # earlier in this call) stays with its holder, so a block got its key exactly
        # where it is its key's holder (no other key names these blocks, checked first).
        blocks, keys = np.asarray(blocks), np.asarray(keys, dtype=np.int64)
        status, fresh, fresh_keys = _register(self.block_key, self.pending,
                                              self._cached.slot, blocks, keys, pending)
        if status == _KEYED:
            raise RuntimeError(f"rank {self.rank}: {request_id} would re-key a cached block "
                               f"(writing into a registered block needs a copy first)")
        if status == _OUTSIDE:  # a key the array does not hold: the index's general way
            holders = self._cached.claim(keys, blocks)
            if holders is None:  # all new and distinct
                fresh, fresh_keys = blocks, keys
            else:
                claimed = holders == blocks
                fresh, fresh_keys = blocks[claimed], keys[claimed]
            self.block_key[fresh] = fresh_keys
            self.pending[fresh] = pending
        else:
            self._cached.claimed(len(fresh))
        if len(fresh) and self.events.wants(BlocksCached):
            self.events.emit(BlocksCached(self.now, self.rank, request_id,
                                          np.array(fresh, dtype=np.int32),
                                          np.array(fresh_keys, dtype=np.int64)))

    def cached_none(self, keys: list) -> bool:
        """Is none of these keys cached?"""
        return self._cached.none_of(keys)

    def all_uncached(self, keys: np.ndarray) -> bool:
        """Are these keys distinct, and none of them cached?"""
        return self._cached.all_new(keys)

    def written(self, blocks: np.ndarray) -> None:
        """The step computing these blocks has run: their KV exists."""
        self.pending[blocks] = False

    def cached_block(self, key: int) -> int:
        """The physical block holding `key`, or -1."""
        return self._cached.get(key)

    def cached_blocks(self, keys: np.ndarray) -> np.ndarray:
        """The physical block holding each key, or -1 (one gather for trace keys)."""
        return self._cached.get_many(keys)

    def cached_prefix(self, keys: np.ndarray, computed_only: bool = False) -> np.ndarray:
        """The blocks holding keys[0], keys[1], ... up to the first key not cached (or,
        `computed_only`, still pending: not yet KV another rank could copy)."""
        keys = np.asarray(keys, dtype=np.int64)
        blocks, known = _held_prefix(self._cached.slot, self.pending, keys, computed_only)
        if known:
            return blocks
        blocks = self._cached.get_many(keys)  # a key outside the key array: one by one
        missing = blocks < 0
        if computed_only:
            missing |= self.pending[blocks]  # (a -1 is missing already)
        return blocks[: int(np.argmax(missing))] if missing.any() else blocks

    def cached_trace_prefix(self, keys, start: int, stop: int,
                            computed_only: bool = False) -> tuple[np.ndarray, bool]:
        """`cached_prefix` of trace keys `keys.key(start) .. keys.key(stop - 1)`, each key
        made as it is probed (`TraceBlockKeys.recipe`), so a walk stops at the first
        miss without making the keys after it: (blocks, True), or (the blocks found up
        to a key outside the key array, False) — the rest is then `cached_prefix`'s."""
        return _held_trace_prefix(self._cached.slot, self.pending, *keys.recipe(),
                                  start, stop, computed_only)

    def unchanged(self, blocks, generations):
        """Elementwise: is block[i] still the one handed out at generations[i]? False
        for a block this pool never handed out (one another pool's hint names)."""
        blocks, generations = np.asarray(blocks), np.asarray(generations)
        known = blocks < len(self.generation)
        same = np.zeros(blocks.shape, dtype=bool)
        same[known] = self.generation[blocks[known]] == generations[known]
        return same

    def still_holds(self, block: int, generation: int, key: int) -> bool:
        """Is `block` still the one handed out at `generation`, and does it hold `key`?
        (`unchanged` and `holds` for one block, without arrays.)"""
        return block < len(self.generation) and int(self.generation[block]) == generation \
            and int(self.block_key[block]) == key

    def holds(self, blocks: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """Elementwise: does block[i] still hold keys[i]?"""
        return self.block_key[blocks] == keys

    def keyed_prefix(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The leading blocks that hold a cache key (only registered blocks do), copied,
        and their generations: what a request leaves cached, as a hint remembers it."""
        return _keyed_prefix(self.block_key, self.generation, blocks)


_loaded: list = []  # [True] once this process has loaded the compiled loops


def load_loops() -> None:
    """Run each compiled loop once (the first time a process asks), on a small pool,
    with the argument types a replay passes. A process's first call of a numba function
    loads it from numba's on-disk cache (compiling it the first time ever): ~0.2 s in
    all, most of it numba setting itself up. So it is paid where the first pool is
    built, with the engine, and not in the middle of the first step that allocates."""
    if _loaded:
        return
    _loaded.append(True)
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    pool.cache_blocks(blocks[:1], np.array([0]))
    pool.cache_blocks(blocks[1:2], np.array([1 << 20]))  # past the key array: it grows
    pool.keyed_prefix(blocks)
    pool.cached_prefix(np.array([0, 1]), computed_only=True)
    _held_trace_prefix(pool._cached.slot, pool.pending, np.zeros(1, np.int64), 1, True, NO_KEYS,
                       NO_KEYS, 0, 1, True)
    pool.would_take_any(2, blocks[:1])
    pool.free(blocks[::-1])
    pool.touch(blocks[:1])
    pool.free(blocks[:1])
    pool.next_to_evict(2)


# The compiled operations: each changes the pool's arrays, the free queue's links and
# the key index's array in one pass over its blocks (which are distinct, and the pool's
# own: unlike numpy's indexing, the loops do not check bounds).

@njit(cache=True)
def _take(prev, next_, state, num_blocks, n, ref_count, block_key, generation, slot):
    """`allocate`: the queue's first n blocks, their keys dropped (`_drop_keys`)."""
    blocks = pop_head(prev, next_, state, num_blocks, n)
    for b in blocks:
        ref_count[b] = 1
        generation[b] += 1
    return (blocks, *_drop_keys(block_key, slot, blocks))


@njit(cache=True)
def _drop_keys(block_key, slot, blocks):
    """The keyed ones of `blocks` lose their keys: (those blocks, their keys, how many
    of the keys the key array held)."""
    evicted = np.empty(len(blocks), dtype=np.int32)
    keys = np.empty(len(blocks), dtype=np.int64)
    m = direct = 0
    for b in blocks:
        key = block_key[b]
        if key != NO_KEY:
            evicted[m], keys[m] = b, key
            m += 1
            direct += clear_slot(slot, key)
            block_key[b] = NO_KEY
    return evicted[:m], keys[:m], direct


@njit(cache=True)
def _idle(ref_count, blocks) -> int:
    n = 0
    for b in blocks:
        n += ref_count[b] == 0
    return n


@njit(cache=True)
def _hold(prev, next_, state, ref_count, blocks) -> None:
    """`touch`: a reference more to each block; an idle one leaves the queue."""
    for b in blocks:
        if ref_count[b] == 0:
            unlink_one(prev, next_, state, b)
        ref_count[b] += 1


@njit(cache=True)
def _release(prev, next_, state, ref_count, blocks) -> bool:
    """`free`: a reference less to each block, in order; one left idle joins the queue's
    tail. False, changing nothing, if a block is not in use."""
    for b in blocks:
        if ref_count[b] <= 0:
            return False
    for b in blocks:
        ref_count[b] -= 1
        if ref_count[b] == 0:
            link_one(prev, next_, state, b)
    return True


_DONE, _KEYED, _OUTSIDE = range(3)  # what `_register` did


@njit(cache=True)
def _register(block_key, pending_mark, slot, blocks, keys, pending: bool):
    """`cache_blocks`: (_DONE, blocks that got their key, their keys); or, changing
    nothing, (_KEYED, ...) if a block holds a key already, (_OUTSIDE, ...) if a key is
    outside the key array (the index's general way registers those)."""
    fresh = np.empty(len(blocks), dtype=np.int32)
    fresh_keys = np.empty(len(blocks), dtype=np.int64)
    for b in blocks:
        if block_key[b] != NO_KEY:
            return _KEYED, fresh[:0], fresh_keys[:0]
    for key in keys:
        if key < 0 or key >= len(slot):
            return _OUTSIDE, fresh[:0], fresh_keys[:0]
    m = 0
    for i in range(len(blocks)):
        b, key = blocks[i], keys[i]
        if claim_slot(slot, key, b) == b:
            block_key[b] = key
            pending_mark[b] = pending
            fresh[m], fresh_keys[m] = b, key
            m += 1
    return _DONE, fresh[:m], fresh_keys[:m]


@njit(cache=True)
def _keyed_prefix(block_key, generation, blocks):
    """(the leading blocks that hold a key, their generations), new arrays."""
    n = len(blocks)
    for i in range(len(blocks)):
        if block_key[blocks[i]] == NO_KEY:
            n = i
            break
    out, gens = np.empty(n, dtype=blocks.dtype), np.empty(n, dtype=generation.dtype)
    for i in range(n):
        out[i] = blocks[i]
        gens[i] = generation[blocks[i]]
    return out, gens


@njit(cache=True)
def _held_prefix(slot, pending, keys, computed_only: bool):
    """`cached_prefix` when the key array decides: (blocks, True); (_, False) if a key
    before the first one missing is outside the array."""
    out = np.empty(len(keys), dtype=np.int32)
    for i in range(len(keys)):
        key = keys[i]
        if key < 0 or key >= len(slot):
            return out[:0], False
        b = slot[key] - 1
        if b < 0 or (computed_only and pending[b]):
            return out[:i], True
        out[i] = b
    return out, True


@njit(cache=True)
def _held_trace_prefix(slot, pending, ids, r: int, split: bool, lent_at, lent_keys,
                       start: int, stop: int, computed_only: bool):
    """`_held_prefix` of trace keys start .. stop - 1, made as `_trace_keys` makes them;
    on a key outside the array: (the blocks before it, False)."""
    out = np.empty(max(stop - start, 0), dtype=np.int32)
    p = 0  # the first lent key not below j
    while p < len(lent_at) and lent_at[p] < start:
        p += 1
    for j in range(start, stop):
        if not split:
            key = ids[(j + 1) * r - 1]
        elif p < len(lent_at) and lent_at[p] == j:
            key = lent_keys[p]
            p += 1
        else:
            key = ids[j // r] * r + j % r
        if key < 0 or key >= len(slot):
            return out[: j - start], False
        b = slot[key] - 1
        if b < 0 or (computed_only and pending[b]):
            return out[: j - start], True
        out[j - start] = b
    return out, True


@njit(cache=True)
def _takes_any(next_, state, num_blocks, n, size, blocks) -> bool:
    """Is one of `blocks` (below `size`, the arrays' length) among the queue's first n?
    One mark per block to be taken (never-used ones, past the arrays, cannot be)."""
    marked = np.zeros(size, dtype=np.bool_)
    for b in walk_head(next_, state, num_blocks, n):
        if b < size:
            marked[b] = True
    for b in blocks:
        if marked[b]:
            return True
    return False
