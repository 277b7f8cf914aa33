"""The offload tiers' eviction policies against naive, independent references.

- LRU against a plain list (head = least recently used) under random operations.
- ARC against `PaperARC`, a second implementation written straight from the
  pseudocode of Megiddo & Modha (FAST'03, Figure 4) with plain lists and an exact
  rational p: Cases I-IV and REPLACE, no shortcuts. Both are driven with the paper's
  "cache access" semantics and must agree after every access on the resident keys,
  the evictions, the ghost lists' sizes and p.
- ARC's invariants after every operation, discards included (which the paper lacks).
- The paper's motivation: ARC resists scans that flush LRU, and gives up little on
  workloads that only reward recency.
"""

import random
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.engine.kv.eviction import ARCPolicy, LRUPolicy, make_policy
from labkit.errors import ConfigError

# ---------------------------------------------------------------- references


class NaiveLRU:
    def __init__(self, capacity):
        self.capacity = capacity
        self.keys = []  # index 0 = least recently used

    def touch(self, key):
        if key not in self.keys:
            raise KeyError(key)
        self.keys.remove(key)
        self.keys.append(key)

    def insert(self, key):
        if key in self.keys:
            raise ValueError(key)
        evicted = []
        if len(self.keys) == self.capacity:
            evicted.append(self.keys.pop(0))
        self.keys.append(key)
        return evicted

    def discard(self, key):
        if key in self.keys:
            self.keys.remove(key)
            return True
        return False


class PaperARC:
    """ARC(c) as printed in the paper; every list has its LRU page at index 0."""

    def __init__(self, c):
        self.c = c
        self.t1, self.t2, self.b1, self.b2 = [], [], [], []
        self.p = Fraction(0)

    def replace(self, x):
        """REPLACE(x_t, p); returns the page removed from the cache."""
        if self.t1 and ((x in self.b2 and len(self.t1) == self.p) or len(self.t1) > self.p):
            page = self.t1.pop(0)
            self.b1.append(page)
        else:
            page = self.t2.pop(0)
            self.b2.append(page)
        return page

    def access(self, x):
        """One request for page x; returns the pages removed from the cache."""
        c = self.c
        if x in self.t1 or x in self.t2:  # Case I
            (self.t1 if x in self.t1 else self.t2).remove(x)
            self.t2.append(x)
            return []
        if x in self.b1:  # Case II
            delta = 1 if len(self.b1) >= len(self.b2) else Fraction(len(self.b2), len(self.b1))
            self.p = min(self.p + delta, c)
            out = [self.replace(x)]
            self.b1.remove(x)
            self.t2.append(x)
            return out
        if x in self.b2:  # Case III
            delta = 1 if len(self.b2) >= len(self.b1) else Fraction(len(self.b1), len(self.b2))
            self.p = max(self.p - delta, 0)
            out = [self.replace(x)]
            self.b2.remove(x)
            self.t2.append(x)
            return out
        out = []  # Case IV
        if len(self.t1) + len(self.b1) == c:  # Case A
            if len(self.t1) < c:
                self.b1.pop(0)
                out.append(self.replace(x))
            else:
                out.append(self.t1.pop(0))
        else:  # Case B: |L1| < c
            total = len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2)
            if total >= c:
                if total == 2 * c:
                    self.b2.pop(0)
                out.append(self.replace(x))
        self.t1.append(x)
        return out


def access(policy, key):
    """The paper's cache access: a hit touches, a miss inserts. Returns the evictions."""
    if key in policy:
        policy.touch(key)
        return []
    return policy.insert(key)


def hit_rate(name, trace, capacity):
    policy = make_policy(name, capacity)
    hits = 0
    for key in trace:
        hits += key in policy
        access(policy, key)
    return hits / len(trace)


# ---------------------------------------------------------------- LRU

ops = st.lists(st.tuples(st.sampled_from(["touch", "insert", "discard", "access"]),
                         st.integers(0, 12)), max_size=120)


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(1, 6), ops=ops)
def test_lru_matches_naive_list(capacity, ops):
    lru, ref = LRUPolicy(capacity), NaiveLRU(capacity)
    for op, key in ops:
        if op == "access":
            op = "touch" if key in ref.keys else "insert"
        try:
            expected = getattr(ref, op)(key)
        except (KeyError, ValueError) as e:
            with pytest.raises(type(e)):
                getattr(lru, op)(key)
        else:
            assert getattr(lru, op)(key) == expected
        assert lru.resident() == ref.keys
        assert len(lru) == len(ref.keys)
        assert all(k in lru for k in ref.keys)


def test_lru_by_hand():
    lru = LRUPolicy(3)
    assert [lru.insert(k) for k in (1, 2, 3)] == [[], [], []]
    lru.touch(1)
    assert lru.insert(4) == [2]
    assert lru.resident() == [3, 1, 4]
    assert 2 not in lru and lru.discard(3) and not lru.discard(3)
    assert lru.insert(5) == []  # the discard left room


# ---------------------------------------------------------------- ARC vs the paper


def expected_resident(ref):
    """ARCPolicy.resident()'s documented order: the list REPLACE takes from next first."""
    if ref.t1 and len(ref.t1) > ref.p:
        return ref.t1 + ref.t2
    return ref.t2 + ref.t1


def assert_same_state(arc, ref):
    assert arc.resident() == expected_resident(ref)
    assert arc.sizes() == {"t1": len(ref.t1), "t2": len(ref.t2),
                           "b1": len(ref.b1), "b2": len(ref.b2)}
    assert arc.p == float(ref.p)


@st.composite
def access_traces(draw):
    capacity = draw(st.integers(1, 8))
    # Keys from a range a few times the capacity, so ghost hits (Cases II, III) occur.
    keys = st.integers(0, 3 * capacity + 1)
    return capacity, draw(st.lists(keys, max_size=300))


@settings(max_examples=200, deadline=None)
@given(access_traces())
def test_arc_matches_paper_pseudocode(trace):
    capacity, keys = trace
    arc, ref = ARCPolicy(capacity), PaperARC(capacity)
    for key in keys:
        assert access(arc, key) == ref.access(key)
        assert_same_state(arc, ref)


@pytest.mark.parametrize("capacity", [1, 2, 7, 32])
def test_arc_matches_paper_on_long_mixed_trace(capacity):
    # Long enough for p to wander across its range: a skewed hot set, loops and scans.
    rng = random.Random(capacity)
    arc, ref = ARCPolicy(capacity), PaperARC(capacity)
    cases = {"ghost": 0, "p_fraction": 0}
    fresh = 10**6
    for step in range(6000):
        phase = (step // 500) % 3
        if phase == 0:
            key = int(rng.paretovariate(1.2)) % (4 * capacity)
        elif phase == 1:
            key = step % (capacity + capacity // 2 + 1)
        else:
            key, fresh = (fresh, fresh + 1) if rng.random() < 0.7 else (rng.randrange(8), fresh)
        cases["ghost"] += key in ref.b1 or key in ref.b2
        assert access(arc, key) == ref.access(key)
        assert_same_state(arc, ref)
        cases["p_fraction"] += ref.p.denominator != 1
    assert cases["ghost"] > 100
    if capacity > 2:
        assert cases["p_fraction"] > 0  # the exact-p path was exercised


def test_arc_by_hand():
    arc = ARCPolicy(2)
    assert arc.insert(1) == [] and arc.insert(2) == []
    arc.touch(1)  # 1 is now frequent (T2)
    assert arc.sizes() == {"t1": 1, "t2": 1, "b1": 0, "b2": 0}
    assert arc.insert(3) == [2]  # |T1| = 1 > p = 0: T1's LRU goes to B1
    # Ghost hit in B1: p rises to 1, so |T1| = 1 no longer exceeds it and REPLACE takes
    # T2's LRU (key 1) into B2; key 2 lands in T2.
    assert arc.insert(2) == [1]
    assert arc.p == 1.0
    assert arc.sizes() == {"t1": 1, "t2": 1, "b1": 0, "b2": 1}
    assert arc.resident() == [2, 3]  # |T1| <= p: T2 is next to give
    assert arc.insert(1) == [3]  # ghost hit in B2: p falls to 0, so T1 gives
    assert arc.p == 0.0
    assert arc.insert(4) == [2]  # brand new, T1 empty: T2's LRU goes to B2
    assert arc.sizes() == {"t1": 1, "t2": 1, "b1": 1, "b2": 1}  # directory full (2c)
    assert arc.insert(5) == [4]  # |L1| = c: B1's LRU (3) is forgotten, T1's LRU goes
    assert arc.sizes() == {"t1": 1, "t2": 1, "b1": 1, "b2": 1}
    assert arc.insert(3) == [5]  # forgotten: a brand-new key again, straight to T1
    assert arc.sizes() == {"t1": 1, "t2": 1, "b1": 1, "b2": 1}


# ---------------------------------------------------------------- ARC invariants

arc_ops = st.lists(st.tuples(st.sampled_from(["access", "access", "access", "touch",
                                              "insert", "discard"]),
                             st.integers(0, 20)), max_size=200)


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(1, 8), ops=arc_ops)
def test_arc_invariants(capacity, ops):
    arc = ARCPolicy(capacity)
    c = capacity
    for op, key in ops:
        before = set(arc.resident())
        first_victim = arc.resident()[0] if before else None
        brand_new = key not in before and key not in arc._b1 and key not in arc._b2
        if op == "access":
            op = "touch" if key in arc else "insert"
        if op == "touch" and key not in before:
            with pytest.raises(KeyError):
                arc.touch(key)
        elif op == "insert" and key in before:
            with pytest.raises(ValueError):
                arc.insert(key)
        elif op == "touch":
            arc.touch(key)
            assert set(arc.resident()) == before
        elif op == "insert":
            evicted = arc.insert(key)
            after = set(arc.resident())
            assert key in after
            assert set(evicted) <= before and not set(evicted) & after
            assert after == (before - set(evicted)) | {key}
            # Evict exactly when full, and exactly one key.
            assert len(evicted) == (1 if len(before) == c else 0)
            if brand_new and evicted:
                assert evicted == [first_victim]  # resident()[0] is the next victim
        else:
            assert arc.discard(key) == (key in before)
            assert set(arc.resident()) == before - {key}
        s = arc.sizes()
        assert s["t1"] + s["t2"] == len(arc) <= c
        assert s["t1"] + s["b1"] <= c
        assert sum(s.values()) <= 2 * c
        assert 0 <= arc.p <= c
        assert len(arc.resident()) == len(arc)
        lists = [set(arc._t1), set(arc._t2), set(arc._b1), set(arc._b2)]
        assert sum(map(len, lists)) == len(set().union(*lists))  # disjoint


def test_arc_discard_leaves_room_even_on_a_ghost_hit():
    arc = ARCPolicy(2)
    for k in (1, 2, 1, 3):
        access(arc, k)  # 1 is frequent, and 3's arrival sends 2 to B1
    assert arc.sizes() == {"t1": 1, "t2": 1, "b1": 1, "b2": 0}
    assert arc.discard(3) and not arc.discard(2)  # 2 is a ghost, not resident
    assert arc.insert(2) == []  # room left by the discard: the paper's REPLACE is skipped
    assert arc.resident() == [1, 2] and arc.p == 1.0


# ---------------------------------------------------------------- behaviour


def hot_loops_and_scans(hot=40, scan=150, rounds=50):
    """A hot set looped twice, then a one-time scan longer than the cache, repeated."""
    trace, fresh = [], 10**6
    for _ in range(rounds):
        trace += 2 * list(range(hot))
        trace += range(fresh, fresh + scan)
        fresh += scan
    return trace


def hot_set_mixed_with_scan(hot=40, n=20000, seed=0):
    """Each access is a random hot key or the next key of an endless scan, half and half."""
    rng, fresh, trace = random.Random(seed), 10**6, []
    for _ in range(n):
        if rng.random() < 0.5:
            trace.append(rng.randrange(hot))
        else:
            trace.append(fresh)
            fresh += 1
    return trace


@pytest.mark.parametrize("trace, margin", [(hot_loops_and_scans(), 0.10),
                                           (hot_set_mixed_with_scan(), 0.05)],
                         ids=["loops", "mixed"])
def test_arc_resists_scans_that_flush_lru(trace, margin):
    lru, arc = hit_rate("lru", trace, 100), hit_rate("arc", trace, 100)
    print(f"hit rate with scans: lru {lru:.3f}  arc {arc:.3f}")
    assert arc >= lru + margin


def lru_stack_trace(n=20000, seed=0, mean_depth=30, p_new=0.15):
    """Pure recency (the LRU stack model): re-use the key at an exponentially
    distributed depth of the recency stack, or a brand-new key."""
    rng, stack, trace, fresh = random.Random(seed), [], [], 0
    for _ in range(n):
        if stack and rng.random() >= p_new:
            key = stack.pop(-1 - min(int(rng.expovariate(1 / mean_depth)), len(stack) - 1))
        else:
            key, fresh = fresh, fresh + 1
        stack.append(key)
        trace.append(key)
    return trace


def test_arc_close_to_lru_on_pure_recency():
    trace = lru_stack_trace()
    lru, arc = hit_rate("lru", trace, 100), hit_rate("arc", trace, 100)
    print(f"hit rate, pure recency: lru {lru:.3f}  arc {arc:.3f}")
    assert lru > 0.5  # the workload does reward recency
    assert arc >= lru - 0.05


# ---------------------------------------------------------------- construction, errors


def test_make_policy():
    for name, cls in (("lru", LRUPolicy), ("arc", ARCPolicy)):
        policy = make_policy(name, 4)
        assert isinstance(policy, cls) and policy.name == name
        assert policy.capacity == 4 and len(policy) == 0 and policy.resident() == []


def test_unknown_policy_lists_the_choices():
    with pytest.raises(ConfigError, match=r"unknown eviction policy 'lfu'; allowed: lru, arc"):
        make_policy("lfu", 4)


@pytest.mark.parametrize("name", ["lru", "arc"])
@pytest.mark.parametrize("capacity", [0, -3])
def test_capacity_below_one_refused(name, capacity):
    with pytest.raises(ConfigError, match=str(capacity)):
        make_policy(name, capacity)


@pytest.mark.parametrize("name", ["lru", "arc"])
def test_misuse_raises(name):
    policy = make_policy(name, 2)
    policy.insert(7)
    with pytest.raises(ValueError, match="7"):
        policy.insert(7)
    with pytest.raises(KeyError):
        policy.touch(8)
    assert 8 not in policy and policy.resident() == [7]  # the failed calls changed nothing
