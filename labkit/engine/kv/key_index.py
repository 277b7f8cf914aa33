"""The prefix cache's index: which physical block holds each key.

A pool looks keys up, registers and drops them by the hundreds per call (a fetched or
freshly computed agentic prompt is thousands of blocks). A Python dict does each key
in ~100-200 ns, most of it cache misses: the table, the entry, then the stored int
object its key is compared with. Trace keys are small, dense integers — the trace
loader numbers a trace's distinct blocks 0, 1, 2, ... and a key is that number times
the blocks per trace block, plus the sub-block (`block_keys.py`) — so they can index an
array directly: one gather or scatter per call, a single memory access per key, no
object per key.

`KeyIndex` keeps keys in ``[0, DIRECT_KEYS)`` in such an array (`slot[key]` is the
block + 1, 0 meaning absent; its pages cost memory only once written, 4 KiB at a time:
`small_pages.py`) and every other key — the chained hashes of token-id prompts, derived
keys of window pages and state snapshots, salted replays of a trace — in a dict. Both
answer exactly as one dict would (`tests/engine/test_block_pool.py` drives the pool
against a naive reference over both ranges).

The array starts small (a small engine stays small) and grows eightfold to the largest
key seen, where it lies (`small_pages.grow_in_place`: nothing copied), or, where the
system cannot do that, by copying what it holds.
"""

from __future__ import annotations

from itertools import repeat

import numpy as np
from numba import njit

from labkit.engine import small_pages

DIRECT_KEYS = 1 << 27  # keys below this are array-indexed (<= 512 MiB, mostly unmapped)
FIRST_KEYS = 1 << 12  # the array's first size: small engines stay small
FEW_KEYS = 8  # claimed one by one in Python


class KeyIndex:
    __slots__ = ("slot", "_other", "_direct_count")

    def __init__(self) -> None:
        # key -> block + 1 (0: absent); its pages are mapped as they are first written
        self.slot = small_pages.zeros(FIRST_KEYS, np.int32)
        self._other: dict[int, int] = {}  # keys outside the array's range
        self._direct_count = 0

    def __len__(self) -> int:
        return self._direct_count + len(self._other)

    def _split(self, keys: np.ndarray) -> np.ndarray:
        """Elementwise: is the key inside the array (as it is now)? A negative key,
        seen unsigned, is past any array."""
        return keys.view(np.uint64) < len(self.slot)

    def _grow(self, keys: np.ndarray) -> None:
        """Make room in the array for the keys below DIRECT_KEYS."""
        small = keys[keys.view(np.uint64) < DIRECT_KEYS]
        if len(small) == 0:
            return
        top = int(small.max()) + 1
        if top <= len(self.slot):
            return
        size = min(max(1 << (top - 1).bit_length(), 8 * len(self.slot)), DIRECT_KEYS)
        if not small_pages.grow_in_place(self, "slot", size):
            self._grow_by_copying(size)

    def _grow_by_copying(self, size: int) -> None:
        """A new array of `size` keys with what this one holds (a scan of it)."""
        slot = small_pages.zeros(size, np.int32)
        held = self.slot.nonzero()[0]  # copy only these: the zero pages stay unmapped
        slot[held] = self.slot[held]
        self.slot = slot

    # ------------------------------------------------------------------ reads
    def get(self, key: int) -> int:
        if 0 <= key < len(self.slot):
            return int(self.slot[key]) - 1
        return self._other.get(key, -1)

    def get_many(self, keys: np.ndarray) -> np.ndarray:
        """The block holding each key, or -1 (int32)."""
        keys = np.asarray(keys, dtype=np.int64)
        inside = self._split(keys)
        if inside.all():
            return self.slot[keys] - 1
        out = np.fromiter(map(self._other.get, keys.tolist(), repeat(-1)), dtype=np.int32,
                          count=len(keys))
        if inside.any():
            out[inside] = self.slot[keys[inside]] - 1
        return out

    def as_dict(self) -> dict[int, int]:
        """Every key and its block (for tests and inspection: O(array))."""
        keys = self.slot.nonzero()[0]
        return {**dict(zip(keys.tolist(), (self.slot[keys] - 1).tolist())), **self._other}

    def all_new(self, keys: np.ndarray) -> bool:
        """Are these keys distinct, and none of them held?"""
        keys = np.asarray(keys, dtype=np.int64)
        answer = distinct_unheld(self.slot, keys)
        if answer >= 0:
            return bool(answer)
        # a key outside the array: those inside as above, the others (a range of their
        # own) distinct among themselves and not in the dict (keys past the array but
        # below DIRECT_KEYS are in neither: the array grows before it takes them)
        inside = self._split(keys)
        if not distinct_unheld(self.slot, keys[inside]):
            return False
        outside = keys[~inside].tolist()
        seen = set(outside)
        return len(seen) == len(outside) and self._other.keys().isdisjoint(seen)

    def none_of(self, keys) -> bool:
        """Is none of these keys held?"""
        keys = np.asarray(keys, dtype=np.int64)
        inside = self._split(keys)
        if inside.any() and self.slot[keys[inside]].any():
            return False
        return self._other.keys().isdisjoint(keys[~inside].tolist())

    # ----------------------------------------------------------------- writes
    def claim(self, keys: np.ndarray, blocks: np.ndarray) -> np.ndarray | None:
        """`dict.setdefault` for each (key, block) in order: a key not held yet is
        claimed by its block (the first of several blocks with one key wins). Returns
        None when every key went to its own block (the usual case: a request's new
        blocks), else each key's holder afterwards. The blocks are distinct."""
        keys = np.asarray(keys, dtype=np.int64)
        if len(keys) <= FEW_KEYS:  # (a decode's new block: numpy calls would cost more)
            listed = keys.tolist()
            if all(key < 0 or key >= DIRECT_KEYS for key in listed):  # dict keys alone
                blocks = np.asarray(blocks).tolist()
                holders = list(map(self._other.setdefault, listed, blocks))
                return None if holders == blocks else np.array(holders, dtype=np.int64)
        if not self._split(keys).all():
            self._grow(keys)
            inside = self._split(keys)
            if not inside.all():
                return self._claim_mixed(keys, blocks, inside)
        holders = np.empty(len(keys), dtype=np.int64)
        new = claim_all(self.slot, keys, np.asarray(blocks), holders)
        self._direct_count += new
        return None if new == len(keys) else holders

    def _claim_mixed(self, keys, blocks, inside) -> np.ndarray:
        holders = np.empty(len(keys), dtype=np.int64)
        if inside.any():
            some = self.claim(keys[inside], blocks[inside])
            holders[inside] = blocks[inside] if some is None else some
        outside = ~inside
        holders[outside] = list(map(self._other.setdefault, keys[outside].tolist(),
                                    blocks[outside].tolist()))
        return holders

    def claimed(self, new: int) -> None:
        """A compiled loop gave `new` array keys their blocks (`claim_slot`)."""
        self._direct_count += new

    def cleared(self, keys: np.ndarray, direct: int) -> None:
        """A compiled loop forgot these held keys, `direct` of them inside the array
        (`clear_slot`): forget the others (dict keys) here."""
        self._direct_count -= direct
        if direct < len(keys):
            for _ in map(self._other.pop, keys[~self._split(keys)].tolist()):
                pass


# The loops the pool's compiled operations share (`block_pool.py`): the array's side of
# `dict.setdefault` and `dict.pop`.

@njit(cache=True, inline="always")
def claim_slot(slot, key, block) -> int:
    """Give `key` (inside the array) to `block` unless it is held; its holder after."""
    held = slot[key]
    if held == 0:
        slot[key] = block + 1
        return block
    return held - 1


@njit(cache=True, inline="always")
def clear_slot(slot, key) -> bool:
    """Forget a held key if it is inside the array; False if it is not (a dict key)."""
    if 0 <= key < len(slot):
        slot[key] = 0
        return True
    return False


@njit(cache=True)
def claim_all(slot, keys, blocks, holders) -> int:
    """`claim_slot` for each (key, block) in order (the first of several blocks with one
    key wins), each key's holder into `holders`; returns how many keys were new."""
    new = 0
    for i in range(len(keys)):
        holders[i] = claim_slot(slot, keys[i], blocks[i])
        new += holders[i] == blocks[i]
    return new


@njit(cache=True)
def distinct_unheld(slot, keys) -> int:
    """1 if the keys are distinct and none is held, 0 if not, -1 if a key is outside the
    array (nothing is decided then). Each key is marked in the array as it is met (-1,
    which no block + 1 is), so a second meeting tells a repeat; the marks are undone."""
    for key in keys:
        if key < 0 or key >= len(slot):
            return -1
    answer, marked = 1, 0
    for key in keys:
        if slot[key] != 0:  # held, or marked: met before
            answer = 0
            break
        slot[key] = -1
        marked += 1
    for i in range(marked):
        slot[keys[i]] = 0
    return answer
