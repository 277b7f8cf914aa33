"""The LRU free queue: which free block gets reused next.

A block whose ref count drops to zero is *free* but keeps its KV and its prefix-cache
key, so a later request can still hit it. When the pool needs a block, it takes the
free block that has been free the longest (least recently used) and only then drops
its key. A hit on a free block takes it out of the queue; when its users are done it
re-enters at the tail. That is vLLM's `FreeKVCacheBlockQueue`.

vLLM keeps a doubly linked list of block objects. We keep the same order with arrays,
because agentic prompts hit and free thousands of blocks per call and a Python loop
per block would dominate the simulation:

- each `append` adds a *segment* (an array of blocks, in the order they should be
  reused) stamped with a fresh number, and stamps its blocks with it;
- `remove` (a hit) just unstamps blocks: their old segment entries become stale;
- `popleft` walks segments from the head and skips entries whose stamp no longer
  matches — amortised O(1) per block, like the linked list, with numpy doing the walk.

Stale entries are compacted away once they outnumber the blocks, so memory stays
O(num_blocks).

Blocks never handed out are not stored at all: a pool starts as one *fresh range*
``[fresh, num_blocks)`` at the head of the queue (they were all free first), and
`popleft` takes from it before any segment. Memory then grows with the blocks a run
touches, not with the pool: a tiny model on an H200 holds 485 million 1-token blocks,
and a run touches a few thousand of them.
"""

from __future__ import annotations

from collections import deque

import numpy as np

NOT_QUEUED = -1
EAGER_BLOCKS = 4096  # per-block arrays start this long (or the pool's size) and double


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
        self._stamp = np.full(min(num_blocks, EAGER_BLOCKS), NOT_QUEUED, dtype=np.int64)
        self._segments: deque[tuple[int, np.ndarray]] = deque()
        self._cursor = 0  # position inside the head segment
        self._next_stamp = 0
        self._entries = 0  # queued entries, stale ones included
        self.fresh = 0  # blocks [fresh, num_blocks) were never handed out
        self.num_free = num_blocks

    def __len__(self) -> int:
        return self.num_free

    def append(self, blocks: np.ndarray) -> None:
        """Queue blocks at the tail, first element to be reused first."""
        if len(blocks) == 0:
            return
        stamp = self._next_stamp
        self._next_stamp += 1
        self._stamp[blocks] = stamp
        self._segments.append((stamp, np.array(blocks, dtype=np.int32)))
        self._entries += len(blocks)
        self.num_free += len(blocks)
        if self._entries > 4 * self.fresh + 1024:
            self._compact()

    def remove(self, blocks: np.ndarray) -> None:
        """Take queued blocks out (they were hit and are in use again)."""
        self._stamp[blocks] = NOT_QUEUED
        self.num_free -= len(blocks)

    def popleft(self, n: int) -> np.ndarray:
        """The n least recently freed blocks, removed from the queue."""
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} free blocks, {self.num_free} available")
        taken: list[np.ndarray] = []
        fresh = min(n, self.num_blocks - self.fresh)
        if fresh:  # never-used blocks come first: they have been free the longest
            taken.append(np.arange(self.fresh, self.fresh + fresh, dtype=np.int32))
            self.fresh += fresh
            self._stamp = grown(self._stamp, self.fresh, self.num_blocks, NOT_QUEUED)
        need = n - fresh
        while need:
            stamp, segment = self._segments[0]
            window = max(2 * need, 64)
            while True:
                chunk = segment[self._cursor : self._cursor + window]
                live = (self._stamp[chunk] == stamp).nonzero()[0]
                if len(live) >= need or self._cursor + window >= len(segment):
                    break
                window *= 4
            if len(live) >= need:
                taken.append(chunk[live[:need]])
                self._cursor += int(live[need - 1]) + 1
                need = 0
            else:
                taken.append(chunk[live])
                need -= len(live)
                self._cursor = len(segment)
            if self._cursor >= len(segment):
                self._entries -= len(segment)
                self._segments.popleft()
                self._cursor = 0
        blocks = taken[0] if len(taken) == 1 else np.concatenate(taken) if taken else \
            np.empty(0, dtype=np.int32)
        self._stamp[blocks] = NOT_QUEUED
        self.num_free -= n
        return blocks

    def peek(self, n: int) -> np.ndarray:
        """The blocks `popleft(n)` would take (all free ones if fewer), the queue as it is."""
        n = min(n, self.num_free)
        fresh = min(n, self.num_blocks - self.fresh)
        parts = [np.arange(self.fresh, self.fresh + fresh, dtype=np.int32)]
        need, cursor = n - fresh, self._cursor
        for stamp, segment in self._segments:
            if not need:
                break
            rest = segment[cursor:]
            live = rest[self._stamp[rest] == stamp][:need]
            parts.append(live)
            need, cursor = need - len(live), 0
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def order(self) -> np.ndarray:
        """All free blocks in reuse order (for tests and views)."""
        return self.peek(self.num_free)

    def _compact(self) -> None:
        live = self.order()[self.num_blocks - self.fresh:]  # the segments' live entries
        stamp = self._next_stamp
        self._next_stamp += 1
        self._stamp[live] = stamp
        self._segments = deque([(stamp, live)])
        self._cursor = 0
        self._entries = len(live)
