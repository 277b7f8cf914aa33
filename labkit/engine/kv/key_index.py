"""The prefix cache's index: which physical block holds each key.

A pool looks keys up, registers and drops them by the hundreds per call (a fetched or
freshly computed agentic prompt is thousands of blocks). A Python dict does each key
in ~100-200 ns, most of it cache misses: the table, the entry, then the stored int
object its key is compared with. Trace keys are small, dense integers — the trace
loader numbers a trace's distinct blocks 0, 1, 2, ... and a key is that number times
the blocks per trace block, plus the sub-block (`block_keys.py`) — so they can index an
array directly: one gather or scatter per call, a single memory access per key, no
object per key.

`KeyIndex` keeps keys in ``[0, DIRECT_KEYS)`` in such an array (`_slot[key]` is the
block + 1, 0 meaning absent; it grows eightfold to the largest key seen, and its
zero pages cost no memory until written) and every other key — the chained hashes of
token-id prompts, derived keys of window pages and state snapshots, salted replays of
a trace — in a dict. Both answer exactly as one dict would (`tests/engine/
test_block_pool.py` drives the pool against a naive reference over both ranges).
"""

from __future__ import annotations

from itertools import repeat

import numpy as np

DIRECT_KEYS = 1 << 27  # keys below this are array-indexed (<= 512 MiB, mostly unmapped)
FIRST_KEYS = 1 << 12  # the array's first size: small engines stay small


class KeyIndex:
    __slots__ = ("_slot", "_other", "_direct_count")

    def __init__(self) -> None:
        # key -> block + 1 (0: absent); its pages are mapped as they are first written
        self._slot = np.zeros(FIRST_KEYS, dtype=np.int32)
        self._other: dict[int, int] = {}  # keys outside the array's range
        self._direct_count = 0

    def __len__(self) -> int:
        return self._direct_count + len(self._other)

    def _split(self, keys: np.ndarray) -> np.ndarray:
        """Elementwise: is the key inside the array (as it is now)? A negative key,
        seen unsigned, is past any array."""
        return keys.view(np.uint64) < len(self._slot)

    def _grow(self, keys: np.ndarray) -> None:
        """Make room in the array for the keys below DIRECT_KEYS."""
        small = keys[keys.view(np.uint64) < DIRECT_KEYS]
        if len(small) == 0:
            return
        top = int(small.max()) + 1
        if top <= len(self._slot):
            return
        # growing copies what is held (a scan of the array): eightfold keeps that rare
        size = max(1 << (top - 1).bit_length(), 8 * len(self._slot))
        slot = np.zeros(min(size, DIRECT_KEYS), dtype=np.int32)
        held = self._slot.nonzero()[0]  # copy only these: the zero pages stay unmapped
        slot[held] = self._slot[held]
        self._slot = slot

    # ------------------------------------------------------------------ reads
    def get(self, key: int) -> int:
        if 0 <= key < len(self._slot):
            return int(self._slot[key]) - 1
        return self._other.get(key, -1)

    def get_many(self, keys: np.ndarray) -> np.ndarray:
        """The block holding each key, or -1 (int32)."""
        keys = np.asarray(keys, dtype=np.int64)
        inside = self._split(keys)
        if inside.all():
            return self._slot[keys] - 1
        out = np.fromiter(map(self._other.get, keys.tolist(), repeat(-1)), dtype=np.int32,
                          count=len(keys))
        if inside.any():
            out[inside] = self._slot[keys[inside]] - 1
        return out

    def as_dict(self) -> dict[int, int]:
        """Every key and its block (for tests and inspection: O(array))."""
        keys = self._slot.nonzero()[0]
        return {**dict(zip(keys.tolist(), (self._slot[keys] - 1).tolist())), **self._other}

    def none_of(self, keys) -> bool:
        """Is none of these keys held?"""
        keys = np.asarray(keys, dtype=np.int64)
        inside = self._split(keys)
        if inside.any() and self._slot[keys[inside]].any():
            return False
        return self._other.keys().isdisjoint(keys[~inside].tolist())

    # ----------------------------------------------------------------- writes
    def claim(self, keys: np.ndarray, blocks: np.ndarray) -> np.ndarray | None:
        """`dict.setdefault` for each (key, block) in order: a key not held yet is
        claimed by its block (the first of several blocks with one key wins). Returns
        None when every key went to its own block (the usual case: a request's new
        blocks), else each key's holder afterwards. The blocks are distinct."""
        keys = np.asarray(keys, dtype=np.int64)
        if not self._split(keys).all():
            self._grow(keys)
            inside = self._split(keys)
            if not inside.all():
                return self._claim_mixed(keys, blocks, inside)
        # each numpy call costs microseconds here: the usual case takes few
        slot = self._slot
        held = slot[keys]
        if not held.any():  # none held yet
            plus = blocks + 1
            slot[keys] = plus
            if (slot[keys] == plus).all():  # and no key twice in the call
                self._direct_count += len(keys)
                return None
            slot[keys] = 0  # a key came twice: undo, and go key by key
            return self._claim_in_order(keys, blocks)
        free = held == 0
        if not free.any():
            return held.astype(np.int64) - 1
        new_keys, plus = keys[free], blocks[free] + 1
        slot[new_keys] = plus
        if (slot[new_keys] == plus).all():
            self._direct_count += len(new_keys)
            return np.where(free, blocks, held - 1)
        slot[new_keys] = 0
        return self._claim_in_order(keys, blocks)

    def _claim_mixed(self, keys, blocks, inside) -> np.ndarray:
        holders = np.empty(len(keys), dtype=np.int64)
        if inside.any():
            some = self.claim(keys[inside], blocks[inside])
            holders[inside] = blocks[inside] if some is None else some
        outside = ~inside
        holders[outside] = list(map(self._other.setdefault, keys[outside].tolist(),
                                    blocks[outside].tolist()))
        return holders

    def _claim_in_order(self, keys, blocks) -> np.ndarray:
        """The exact, key-by-key claim (a call with one key twice); all keys are inside
        the array."""
        slot, holders = self._slot, np.empty(len(keys), dtype=np.int64)
        for i, (key, block) in enumerate(zip(keys.tolist(), blocks.tolist())):
            held = int(slot[key])
            if held == 0:
                slot[key] = held = block + 1
                self._direct_count += 1
            holders[i] = held - 1
        return holders

    def drop(self, keys: np.ndarray) -> None:
        """Forget keys that are held (each once)."""
        keys = np.asarray(keys, dtype=np.int64)
        inside = self._split(keys)
        if inside.all():
            self._slot[keys] = 0
            self._direct_count -= len(keys)
            return
        if inside.any():
            self._slot[keys[inside]] = 0
            self._direct_count -= int(inside.sum())
        # a C-level loop; `pop` is called without building an argument tuple per key
        for _ in map(self._other.pop, keys[~inside].tolist()):
            pass
