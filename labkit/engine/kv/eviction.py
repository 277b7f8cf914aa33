"""Eviction policies for the KV offload tiers: which block keys a full tier keeps.

Below the GPU, KV blocks can be offloaded to a CPU-DRAM tier and further to a disk
tier. Each tier holds at most `capacity` blocks, named by their block key (the chained
hash of the block and its whole prefix). The tier stores the contents; a policy only
tracks keys and answers one question when a new block arrives at a full tier: *which
resident key goes?* The tier drives it with

- `touch(key)` when a resident block is used (a hit),
- `insert(key)` when a block is brought in; it returns the keys evicted to make room,
- `discard(key)` when the tier drops a block for its own reasons (invalidated, moved).

Two policies:

- **LRU** evicts the key used least recently. Cheap and good for recency, but a long
  one-time scan (a big prompt that is never repeated) flushes the whole tier, hot
  shared prefixes included.
- **ARC** (Megiddo & Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache",
  FAST'03) splits the resident keys into T1 (seen once recently) and T2 (seen at least
  twice) and remembers the keys recently evicted from each in *ghost* lists B1 and B2
  (keys only, no contents). A miss that hits a ghost list is evidence that the list it
  came from was given too little room, so the target size `p` of T1 moves towards it.
  A scan only ever lands in T1, so the frequently reused keys in T2 survive it.

Every operation is O(1) amortised: all lists are insertion-ordered dicts, whose first
entry is the LRU end and last entry the MRU end.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from fractions import Fraction

from labkit.errors import ConfigError, unknown_choice

POLICIES = ("lru", "arc")


def _check_capacity(capacity: int) -> int:
    if capacity < 1:
        raise ConfigError(f"an eviction policy needs a capacity of at least 1 block, "
                          f"got {capacity}")
    return capacity


class EvictionPolicy(ABC):
    """Which of at most `capacity` block keys stay resident in a tier."""

    __slots__ = ("capacity",)
    name: str = ""

    def __init__(self, capacity: int) -> None:
        self.capacity = _check_capacity(capacity)

    @abstractmethod
    def __contains__(self, key: int) -> bool:
        """Is `key` resident? A peek: it does not count as an access."""

    @abstractmethod
    def __len__(self) -> int:
        """How many keys are resident."""

    @abstractmethod
    def touch(self, key: int) -> None:
        """Record a use of resident `key` (KeyError if it is not resident)."""

    @abstractmethod
    def insert(self, key: int) -> list[int]:
        """Make non-resident `key` resident; return the keys evicted for it, in order.

        ValueError if `key` is already resident (that is a `touch`)."""

    @abstractmethod
    def discard(self, key: int) -> bool:
        """Drop `key` without remembering it; return whether it was resident."""

    @abstractmethod
    def resident(self) -> list[int]:
        """The resident keys, next victim first."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(capacity={self.capacity}, resident={len(self)})"


def _already_resident(key: int) -> ValueError:
    return ValueError(f"block key {key} is already resident; use touch() for a hit")


class LRUPolicy(EvictionPolicy):
    """Evict the key whose last use is oldest."""

    __slots__ = ("_keys",)
    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._keys: OrderedDict[int, None] = OrderedDict()  # LRU first

    def __contains__(self, key: int) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def touch(self, key: int) -> None:
        self._keys.move_to_end(key)  # raises KeyError for a missing key

    def insert(self, key: int) -> list[int]:
        if key in self._keys:
            raise _already_resident(key)
        evicted = []
        if len(self._keys) >= self.capacity:
            evicted.append(self._keys.popitem(last=False)[0])
        self._keys[key] = None
        return evicted

    def discard(self, key: int) -> bool:
        if key in self._keys:
            del self._keys[key]
            return True
        return False

    def resident(self) -> list[int]:
        return list(self._keys)


class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache, following the paper's pseudocode (its Figure 4).

    `touch` is the paper's Case I (a cache hit) and `insert` its Cases II-IV (a miss,
    found in B1, in B2, or nowhere). `p`, the target size of T1, is a real number as
    in the paper: the adaptation steps |B2|/|B1| and |B1|/|B2| need not be whole. It
    is kept as an exact Fraction, because REPLACE compares it with the integer |T1|
    and a float sum of such steps can land a hair below a whole number (2.9999...),
    which would flip that comparison.

    One extension: `discard` drops a resident key without a ghost entry, which the
    paper has no counterpart for. It can leave the cache below capacity while ghosts
    remain, so REPLACE (which frees one cache slot) only runs when the cache is full;
    without discards that is always the case where the paper calls it.
    """

    __slots__ = ("_t1", "_t2", "_b1", "_b2", "_p")
    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        # Each dict: LRU end first, MRU end last. T1/T2 are resident, B1/B2 ghosts.
        self._t1: OrderedDict[int, None] = OrderedDict()
        self._t2: OrderedDict[int, None] = OrderedDict()
        self._b1: OrderedDict[int, None] = OrderedDict()
        self._b2: OrderedDict[int, None] = OrderedDict()
        self._p = Fraction(0)

    # ------------------------------------------------------------ inspection
    @property
    def p(self) -> float:
        """The adaptive target size of T1, in [0, capacity] (exact value rounded)."""
        return float(self._p)

    def sizes(self) -> dict[str, int]:
        return {"t1": len(self._t1), "t2": len(self._t2),
                "b1": len(self._b1), "b2": len(self._b2)}

    def __contains__(self, key: int) -> bool:
        return key in self._t1 or key in self._t2

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def resident(self) -> list[int]:
        """T1 then T2 (each LRU first), or T2 then T1 when REPLACE would take from T2.

        The first key is the next victim of a brand-new key arriving at a full cache.
        (A miss in B2 with |T1| == p takes T1's LRU instead; later victims depend on
        how p moves, so the rest of the order is only the lists' own LRU order.)"""
        if self._replace_takes_t1(in_b2=False):
            return [*self._t1, *self._t2]
        return [*self._t2, *self._t1]

    # ------------------------------------------------------------ operations
    def touch(self, key: int) -> None:
        # Case I: a hit, in T1 or T2, makes the key frequent: MRU end of T2.
        if key in self._t1:
            del self._t1[key]
        elif key in self._t2:
            del self._t2[key]
        else:
            raise KeyError(key)
        self._t2[key] = None

    def insert(self, key: int) -> list[int]:
        if key in self:
            raise _already_resident(key)
        c = self.capacity
        b1, b2 = self._b1, self._b2
        evicted: list[int] = []
        if key in b1:
            # Case II: T1 evicted this key too early, so T1 deserves more room.
            self._p = min(Fraction(c), self._p + max(1, Fraction(len(b2), len(b1))))
            del b1[key]
            self._replace_if_full(in_b2=False, evicted=evicted)
            self._t2[key] = None
        elif key in b2:
            # Case III: T2 evicted it too early, so shrink T1's target instead.
            self._p = max(Fraction(0), self._p - max(1, Fraction(len(b1), len(b2))))
            del b2[key]
            self._replace_if_full(in_b2=True, evicted=evicted)
            self._t2[key] = None
        else:
            # Case IV: a new key. Keep |L1| = |T1|+|B1| <= c and the directory <= 2c.
            t1 = self._t1
            if len(t1) + len(b1) == c:
                if len(t1) < c:
                    b1.popitem(last=False)
                    self._replace_if_full(in_b2=False, evicted=evicted)
                else:
                    # B1 is empty and T1 fills the cache: its LRU goes, unremembered.
                    evicted.append(t1.popitem(last=False)[0])
            elif len(t1) + len(self._t2) + len(b1) + len(b2) >= c:
                if len(t1) + len(self._t2) + len(b1) + len(b2) == 2 * c:
                    b2.popitem(last=False)
                self._replace_if_full(in_b2=False, evicted=evicted)
            t1[key] = None
        return evicted

    def discard(self, key: int) -> bool:
        # Ghosts are left alone: they are history, not contents, and a non-resident
        # key has nothing to drop.
        if key in self._t1:
            del self._t1[key]
            return True
        if key in self._t2:
            del self._t2[key]
            return True
        return False

    # ------------------------------------------------------------ REPLACE
    def _replace_takes_t1(self, in_b2: bool) -> bool:
        """The paper's test: take from T1 if it exceeds its target p (or meets it on a
        B2 miss, whose key is about to grow T2)."""
        n1 = len(self._t1)
        return n1 > 0 and (n1 > self._p or (in_b2 and n1 == self._p))

    def _replace_if_full(self, in_b2: bool, evicted: list[int]) -> None:
        """REPLACE: move one resident key to its ghost list, freeing a cache slot."""
        if len(self._t1) + len(self._t2) < self.capacity:
            return  # only after a discard: there is already room
        if self._replace_takes_t1(in_b2):
            victim = self._t1.popitem(last=False)[0]
            self._b1[victim] = None
        else:
            victim = self._t2.popitem(last=False)[0]
            self._b2[victim] = None
        evicted.append(victim)


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """The eviction policy called `name` ("lru" or "arc") for a tier of `capacity` blocks."""
    if name == "lru":
        return LRUPolicy(capacity)
    if name == "arc":
        return ARCPolicy(capacity)
    raise unknown_choice("eviction policy", name, POLICIES)
