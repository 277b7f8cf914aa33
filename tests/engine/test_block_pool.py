"""The block pool against a naive, list-based reference of vLLM's block pool.

The reference keeps the free queue as a plain Python list (head = next to reuse),
exactly as vLLM's doubly linked list orders it: freed blocks appended in the order
given, hits removed from the middle, allocations popped from the head (dropping their
cache keys). Any sequence of operations must leave both pools in the same state.
"""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.engine.kv.block_keys import TraceBlockKeys
from labkit.engine.kv.block_pool import BlockPool
from labkit.engine.kv.key_index import DIRECT_KEYS


class NaivePool:
    def __init__(self, n):
        self.ref = [0] * n
        self.key = [None] * n
        self.cached = {}
        self.free = list(range(n))

    def allocate(self, k):
        taken, self.free = self.free[:k], self.free[k:]
        for b in taken:
            if self.key[b] is not None:
                del self.cached[self.key[b]]
                self.key[b] = None
            self.ref[b] = 1
        return taken

    def touch(self, blocks):
        for b in blocks:
            if self.ref[b] == 0:
                self.free.remove(b)
            self.ref[b] += 1

    def release(self, blocks):
        for b in blocks:
            self.ref[b] -= 1
        self.free.extend(b for b in blocks if self.ref[b] == 0)

    def cache(self, blocks, keys):
        for b, k in zip(blocks, keys):
            if k not in self.cached:
                self.cached[k] = b
                self.key[b] = k


def _leading_blocks(ref, marked, keys, computed_only):
    """The reference's blocks for keys[0], keys[1], ... up to the first not cached (or,
    computed_only, registered by a step yet to run)."""
    lead = []
    for k in keys:
        b = ref.cached.get(k, -1)
        if b < 0 or (computed_only and b in marked):
            break
        lead.append(b)
    return lead


def _trace_keys_over(order):
    """Trace keys of each recipe: blocks as large as the trace's (the keys are `order`),
    half as large (two sub-block keys per id), twice as large (the later id of each
    pair is the key: `order` again), a quarter as large with keys lent by another
    call's."""
    pairs = np.stack([order + 7, order], axis=1).ravel()
    lent = TraceBlockKeys(order + 7, 4, 1)  # every other key lent: `order`'s
    lent.lent_at = np.arange(0, 2 * len(order), 2, dtype=np.int64)
    lent.lent_keys = np.asarray(order, dtype=np.int64)
    return [TraceBlockKeys(order, 4, 4), TraceBlockKeys(order, 4, 2),
            TraceBlockKeys(pairs, 2, 4), lent]


ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "touch", "free", "cache"]),
              st.integers(0, 10_000), st.integers(1, 6)),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(ops, st.integers(4, 40))
def test_pool_matches_naive_reference(operations, num_blocks):
    check_against_reference(operations, num_blocks)


@settings(max_examples=100, deadline=None)
@given(ops, st.integers(4, 40))
def test_a_pool_whose_arrays_grow_as_blocks_are_used_matches_the_reference(operations,
                                                                          num_blocks):
    """Per-block arrays start 2 long and grow as blocks are first handed out (a pool of
    10^12 blocks costs only the blocks a run touches): same behaviour, block for block."""
    from unittest import mock

    with mock.patch("labkit.engine.kv.block_pool.EAGER_BLOCKS", 2), \
            mock.patch("labkit.engine.kv.free_queue.EAGER_BLOCKS", 2):
        check_against_reference(operations, num_blocks, lazy=True)


def check_against_reference(operations, num_blocks, lazy=False):
    pool, ref = BlockPool(num_blocks), NaivePool(num_blocks)
    assert len(pool.ref_count) == (2 if lazy else num_blocks)
    held: list[list[int]] = []  # groups of blocks some "request" holds
    next_key = 0
    for op, pick, size in operations:
        if op == "alloc":
            size = min(size, len(ref.free))
            if size == 0:
                continue
            got = pool.allocate(size).tolist()
            assert got == ref.allocate(size)
            held.append(got)
        elif op == "touch":
            cached = sorted(ref.cached.items())
            if not cached:
                continue
            blocks = [b for _, b in cached[pick % len(cached):][:size]]
            pool.touch(np.array(blocks, dtype=np.int32))
            ref.touch(blocks)
            held.append(blocks)
        elif op == "free" and held:
            group = held.pop(pick % len(held))
            pool.free(np.array(group[::-1], dtype=np.int32))
            ref.release(group[::-1])
        elif op == "cache" and held:
            group = held[pick % len(held)]
            keys = list(range(next_key, next_key + len(group)))
            if pick % 3 == 0 and ref.cached:  # sometimes a key another block already has
                keys[0] = next(iter(ref.cached))
            if pick % 5 == 1 and len(keys) > 1:  # or twice in one call: the first block wins
                keys[-1] = keys[0]
            next_key += len(group)
            fresh = [(b, k) for b, k in zip(group, keys) if ref.key[b] is None]
            blocks = np.array([b for b, _ in fresh], dtype=np.int32)
            pool.cache_blocks(blocks, np.array([k for _, k in fresh], dtype=np.int64))
            ref.cache([b for b, _ in fresh], [k for _, k in fresh])
        assert pool.free_order().tolist() == ref.free
        # what the next allocations would take, seen without taking it
        assert pool.next_to_evict(size + pick % 7).tolist() == ref.free[: size + pick % 7]
        # ...and whether it would take one of some blocks handed out (cached, or held)
        some = sorted(ref.cached.values())[pick % 3 :: 2] + [g[0] for g in held[:2] if g]
        assert pool.would_take_any(size + pick % 7, np.array(some, dtype=np.int32)) == \
            bool(set(ref.free[: size + pick % 7]) & set(some))
        assert pool.free_order().tolist() == ref.free
        assert pool.num_idle(np.array(some, dtype=np.int32)) == sum(ref.ref[b] == 0
                                                                     for b in some)
        refs = pool.ref_count.tolist()
        if lazy:  # blocks past the arrays were never used: ref count 0
            refs += [0] * (num_blocks - len(refs))
        assert refs == ref.ref
        assert pool.num_free == len(ref.free)
        assert pool.num_free + pool.num_used == num_blocks
        assert {k: pool.cached_block(k) for k in ref.cached} == ref.cached
        assert pool.num_cached == len(ref.cached)


def test_many_hit_and_free_cycles_keep_the_order():
    pool, ref = BlockPool(8), NaivePool(8)
    for _ in range(200):  # many hit/free cycles leave stale entries behind
        blocks = pool.allocate(3)
        ref.allocate(3)
        pool.free(blocks[::-1])
        ref.release(blocks.tolist()[::-1])
        pool.touch(blocks[:1])
        ref.touch(blocks.tolist()[:1])
        pool.free(blocks[:1])
        ref.release(blocks.tolist()[:1])
    assert pool.free_order().tolist() == ref.free


def test_freeing_an_unused_block_is_an_error():
    pool = BlockPool(4)
    try:
        pool.free(np.array([0], dtype=np.int32))
    except RuntimeError as err:
        assert "not in use" in str(err)
    else:
        raise AssertionError("expected an error")


def test_eviction_drops_the_key_and_generation_moves():
    pool = BlockPool(2)
    a = pool.allocate(2)
    pool.cache_blocks(a, np.array([7, 8]))
    gen = pool.generation[a].copy()
    pool.free(a[::-1])  # block a[1] first in line for reuse
    assert pool.cached_block(8) == a[1]
    b = pool.allocate(1)
    assert b[0] == a[1] and pool.cached_block(8) == -1 and pool.cached_block(7) == a[0]
    assert pool.generation[b[0]] == gen[1] + 1


def test_evicted_keys_are_gone_and_come_back_like_the_reference():
    """Keys from a small range make evicted keys come back, twins in one call, keys
    held elsewhere and blocks re-keyed after reuse (the hypothesis test above draws
    fresh keys). Every lookup path must agree with the reference over the whole key
    range, after every operation. From seed 10 on, the keys mix the index's two homes:
    small ones (array-indexed), and large and negative ones (a dict)."""
    for seed in range(30):
        rng = np.random.default_rng(seed)
        n = int(rng.integers(4, 24))
        pool, ref = BlockPool(n), NaivePool(n)
        held: list[list[int]] = []
        marked = set()  # blocks registered by a step yet to run
        key_range = int(rng.integers(3, 3 * n))
        key_of = np.arange(key_range, dtype=np.int64)
        if seed >= 10:
            # (1 << 14: past the array as it starts, which grows to hold it)
            homes = np.array([0, 1 << 14, DIRECT_KEYS, -(1 << 40), 1 << 62], dtype=np.int64)
            key_of = key_of + homes[rng.integers(0, 5, key_range)]
        for _ in range(150):
            op = rng.integers(4)
            if op == 0 and ref.free:
                size = int(rng.integers(1, len(ref.free) + 1))
                got = pool.allocate(size).tolist()
                assert got == ref.allocate(size)
                held.append(got)
            elif op == 1 and held:
                group = held.pop(int(rng.integers(len(held))))
                pool.free(np.array(group[::-1], dtype=np.int32))
                ref.release(group[::-1])
            elif op == 2 and ref.cached:
                blocks = sorted(set(rng.choice(list(ref.cached.values()),
                                               int(rng.integers(1, 4))).tolist()))
                pool.touch(np.array(blocks, dtype=np.int32))
                ref.touch(blocks)
                held.append(blocks)
            elif held:
                group = [b for b in held[int(rng.integers(len(held)))] if ref.key[b] is None]
                keys = key_of[rng.integers(0, key_range, len(group))].tolist()
                pending = bool(rng.integers(2))  # registered by a step yet to run
                pool.cache_blocks(np.array(group, dtype=np.int32),
                                  np.array(keys, dtype=np.int64), pending=pending)
                before = set(ref.cached.values())
                ref.cache(group, keys)
                got = set(ref.cached.values()) - before
                marked = (marked - got) | (got if pending else set())
            if marked and rng.integers(3) == 0:  # some pending steps run
                ran = sorted(marked)[: int(rng.integers(1, len(marked) + 1))]
                pool.written(np.array(ran, dtype=np.int32))
                marked -= set(ran)
            # a lookup's leading cached blocks, computed ones only or all
            order = key_of[rng.permutation(key_range)[: int(rng.integers(0, key_range + 1))]]
            for computed_only in (False, True):
                lead = _leading_blocks(ref, marked, order.tolist(), computed_only)
                assert pool.cached_prefix(order, computed_only).tolist() == lead
                # the same walk with each key made as it is probed, from trace ids
                for keys in _trace_keys_over(order):
                    start = int(rng.integers(0, keys.num_blocks + 1))
                    made = keys.keys(start, keys.num_blocks).tolist()
                    lead = _leading_blocks(ref, marked, made, computed_only)
                    blocks, known = pool.cached_trace_prefix(keys, start, keys.num_blocks,
                                                             computed_only)
                    m = len(blocks)
                    assert blocks.tolist() == lead[:m]
                    if known:
                        assert m == len(lead)
                    else:  # stopped at a key the dict holds, if any: the rest by chunks
                        assert not 0 <= made[m] < len(pool._cached.slot)
            if held:  # what a request freeing this group would leave as a hint
                group = held[int(rng.integers(len(held)))]
                keyed = next((i for i, b in enumerate(group) if ref.key[b] is None),
                             len(group))
                blocks, gens = pool.keyed_prefix(np.array(group, dtype=np.int32))
                assert blocks.tolist() == group[:keyed]
                assert gens.tolist() == [int(pool.generation[b]) for b in group[:keyed]]
            b = int(rng.integers(n))
            if ref.key[b] is not None:
                gen = int(pool.generation[b])
                assert pool.still_holds(b, gen, ref.key[b])
                assert not pool.still_holds(b, gen + 1, ref.key[b])
                assert not pool.still_holds(b, gen, ref.key[b] + 1)
            expect = [ref.cached.get(k, -1) for k in key_of.tolist()]
            assert pool.cached_blocks(key_of).tolist() == expect
            assert [pool.cached_block(k) for k in key_of.tolist()] == expect
            assert pool._cached.as_dict() == ref.cached and pool.num_cached == len(ref.cached)
            some = key_of[rng.integers(0, key_range, 3)].tolist()
            assert pool.cached_none(some) == all(k not in ref.cached for k in some)
            assert pool.all_uncached(np.array(some, dtype=np.int64)) == (
                len(set(some)) == len(some) and all(k not in ref.cached for k in some))
            assert pool.free_order().tolist() == ref.free


def test_the_free_queue_alone_keeps_vllms_order():
    """`FreeBlockQueue` by itself, against a list: never-used blocks first, then freed
    ones in the order freed; a hit takes a block out of the middle."""
    from labkit.engine.kv.free_queue import FreeBlockQueue

    for seed in range(20):
        rng = np.random.default_rng(seed)
        n = int(rng.integers(1, 30))
        queue, ref, used = FreeBlockQueue(n), list(range(n)), []
        for _ in range(100):
            op = rng.integers(3)
            if op == 0 and ref:
                k = int(rng.integers(1, len(ref) + 1))
                assert queue.popleft(k).tolist() == ref[:k]
                used += ref[:k]
                ref = ref[k:]
            elif op == 1 and used:
                back = [used.pop(int(rng.integers(len(used))))
                        for _ in range(int(rng.integers(1, len(used) + 1)))]
                queue.append(np.array(back, dtype=np.int32))
                ref += back
            elif op == 2 and ref[n - queue.fresh:]:  # a hit on blocks freed before
                freed = ref[n - queue.fresh:]
                hit = sorted(set(rng.choice(freed, int(rng.integers(1, len(freed) + 1)))))
                queue.remove(np.array(hit, dtype=np.int32))
                ref = [b for b in ref if b not in hit]
                used += hit
            assert queue.order().tolist() == ref and queue.num_free == len(ref)
            assert queue.peek(3).tolist() == ref[:3]
        try:
            queue.popleft(len(ref) + 1)
        except RuntimeError as err:
            assert "available" in str(err)
        else:
            raise AssertionError("expected an error")


def test_a_trace_key_made_alone_is_the_key_made_among_others():
    """`TraceBlockKeys.key(j)` (Python numbers, for one probe) equals `keys(j, j + 1)`
    (the compiled int64 loop) for every recipe, lent keys included -- also for ids so
    large that a sub-block's key passes int64's range, where both wrap alike (a Python
    int would not: key 2**62 * 4 is 2**64, which int64 holds as 0)."""
    for base in (0, 1 << 40, (1 << 62) - 3, -(1 << 62)):
        order = base + np.array([5, 0, 9, 2], dtype=np.int64)
        for keys in _trace_keys_over(order):
            made = keys.keys(0, keys.num_blocks).tolist()
            assert [keys.key(j) for j in range(keys.num_blocks)] == made
            assert all(-(1 << 63) <= k < (1 << 63) for k in made)
    wrapped = TraceBlockKeys(np.array([1 << 62], dtype=np.int64), 4, 1)  # ratio 4
    assert wrapped.key(0) == 0 and wrapped.key(3) == 3  # (2**64 + j wraps to j)
