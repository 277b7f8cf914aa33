"""The LRU free queue: which free block gets reused next.

A block whose ref count drops to zero is *free* but keeps its KV and its prefix-cache
key, so a later request can still hit it. When the pool needs a block, it takes the
free block that has been free the longest (least recently used) and only then drops
its key. A hit on a free block takes it out of the queue; when its users are done it
re-enters at the tail. That is vLLM's `FreeKVCacheBlockQueue`.

vLLM keeps a doubly linked list of block objects; so do we, as two arrays of block
numbers — `prev[b]` and `next[b]` — and compiled loops over them (`numba`): freeing
appends at the tail, a hit unlinks a block from the middle, an allocation pops from
the head, each a few memory accesses per block. Agentic prompts hit and free thousands
of blocks per call, and most calls of a replay move a handful: a Python loop per block
would dominate the first, a dozen numpy calls per operation the second.

Blocks never handed out are not linked at all: a pool starts as one *fresh range*
``[fresh, num_blocks)`` at the head of the queue (they were all free first), and a pop
takes from it before the list. The arrays cover the blocks handed out so far (they
grow by doubling, `grown`), so memory follows the blocks a run touches, not the pool:
a tiny model on an H200 holds 485 million 1-token blocks, and a run touches a few
thousand of them.

The queue's four numbers (head, tail, fresh, free count) live in one small array, so
that a compiled loop (`block_pool.py` composes these with its own) updates them in place.
"""

from __future__ import annotations

import numpy as np
from numba import njit

NONE = -1  # no block: the end of the list
EAGER_BLOCKS = 4096  # per-block arrays start this long (or the pool's size) and double
HEAD, TAIL, FRESH, NUM_FREE = range(4)  # the entries of `FreeBlockQueue.state`


def grown(array: np.ndarray, needed: int, limit: int, fill) -> np.ndarray:
    """`array` extended (doubling, at most to `limit`) to hold index needed - 1; new
    entries are `fill`. The array itself when it is long enough."""
    if needed <= len(array):
        return array
    size = min(limit, max(needed, 2 * len(array)))
    return np.concatenate([array, np.full(size - len(array), fill, dtype=array.dtype)])


class FreeBlockQueue:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        size = min(num_blocks, EAGER_BLOCKS)
        self.prev = np.full(size, NONE, dtype=np.int32)
        self.next = np.full(size, NONE, dtype=np.int32)
        self.state = np.array([NONE, NONE, 0, num_blocks], dtype=np.int64)

    @property
    def fresh(self) -> int:
        """Blocks [fresh, num_blocks) were never handed out."""
        return int(self.state[FRESH])

    @property
    def num_free(self) -> int:
        return int(self.state[NUM_FREE])

    def __len__(self) -> int:
        return self.num_free

    def make_room(self, n: int) -> int:
        """Before n blocks are taken: check there are n, and cover the never-used ones
        among them (first use of blocks past the arrays). Returns the length the
        per-block arrays must have (the pool's too)."""
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} free blocks, {self.num_free} available")
        fresh = self.fresh
        needed = fresh + min(n, self.num_blocks - fresh)
        self.prev = grown(self.prev, needed, self.num_blocks, NONE)
        self.next = grown(self.next, needed, self.num_blocks, NONE)
        return needed

    def append(self, blocks: np.ndarray) -> None:
        """Queue blocks at the tail, first element to be reused first."""
        link_tail(self.prev, self.next, self.state, np.asarray(blocks, dtype=np.int32))

    def remove(self, blocks: np.ndarray) -> None:
        """Take queued blocks out (they were hit and are in use again)."""
        unlink(self.prev, self.next, self.state, np.asarray(blocks, dtype=np.int32))

    def popleft(self, n: int) -> np.ndarray:
        """The n least recently freed blocks, removed from the queue."""
        self.make_room(n)
        return pop_head(self.prev, self.next, self.state, self.num_blocks, n)

    def peek(self, n: int) -> np.ndarray:
        """The blocks `popleft(n)` would take (all free ones if fewer), the queue as it is."""
        return walk_head(self.next, self.state, self.num_blocks, min(n, self.num_free))

    def order(self) -> np.ndarray:
        """All free blocks in reuse order (for tests and views)."""
        return self.peek(self.num_free)


# The loops. `state` is the queue's (head, tail, fresh, free count); blocks are int32.

@njit(cache=True, inline="always")
def link_one(prev, next_, state, b) -> None:
    """Append block b (not queued) at the tail."""
    tail = state[TAIL]
    prev[b] = tail
    next_[b] = NONE
    if tail == NONE:
        state[HEAD] = b
    else:
        next_[tail] = b
    state[TAIL] = b
    state[NUM_FREE] += 1


@njit(cache=True, inline="always")
def unlink_one(prev, next_, state, b) -> None:
    """Take queued block b out of the list."""
    p, n = prev[b], next_[b]
    if p == NONE:
        state[HEAD] = n
    else:
        next_[p] = n
    if n == NONE:
        state[TAIL] = p
    else:
        prev[n] = p
    state[NUM_FREE] -= 1


@njit(cache=True)
def link_tail(prev, next_, state, blocks) -> None:
    for b in blocks:
        link_one(prev, next_, state, b)


@njit(cache=True)
def unlink(prev, next_, state, blocks) -> None:
    for b in blocks:
        unlink_one(prev, next_, state, b)


@njit(cache=True)
def pop_head(prev, next_, state, num_blocks, n):
    """Remove and return the first n blocks: never-used ones first, then the list's
    head. The caller checked there are n and that the arrays cover the fresh ones."""
    out = walk_head(next_, state, num_blocks, n)
    fresh = min(n, num_blocks - state[FRESH])
    state[FRESH] += fresh
    if n > fresh:
        b = next_[out[n - 1]]
        state[HEAD] = b
        if b == NONE:
            state[TAIL] = NONE
        else:
            prev[b] = NONE
    state[NUM_FREE] -= n
    return out


@njit(cache=True)
def walk_head(next_, state, num_blocks, n):
    """The first n blocks (n at most the free count), the queue unchanged."""
    out = np.empty(n, dtype=np.int32)
    fresh = min(n, num_blocks - state[FRESH])
    for i in range(fresh):
        out[i] = state[FRESH] + i
    b = state[HEAD]
    for i in range(fresh, n):
        out[i] = b
        b = next_[b]
    return out
