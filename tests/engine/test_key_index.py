"""The prefix cache's index (`kv/key_index.py`) answers as one dict would: claims
(`dict.setdefault`) of keys from both of its homes — small keys in the array, large and
negative ones in the dict — a few at a time (a decode's new block: claimed in Python)
and many (a prompt's blocks: compiled), twins within a call included."""

import numpy as np

from labkit.engine.kv.key_index import DIRECT_KEYS, FEW_KEYS, KeyIndex


def test_claims_answer_as_dict_setdefault():
    for seed in range(20):
        rng = np.random.default_rng(seed)
        index, ref = KeyIndex(), {}
        # the homes: the array as it starts, past it (it grows), the dict (large, negative)
        homes = np.array([0, 1 << 14, DIRECT_KEYS, 1 << 40, -(1 << 40)], dtype=np.int64)
        pool = rng.integers(0, 30, 200) + homes[rng.integers(0, len(homes), 200)]
        if seed % 2:  # dict keys alone
            pool = pool[(pool < 0) | (pool >= DIRECT_KEYS)]
        next_block = 0
        for _ in range(60):
            size = int(rng.integers(1, 2 * FEW_KEYS + 2))
            keys = rng.choice(pool, size)  # (twins now and then)
            blocks = np.arange(next_block, next_block + size, dtype=np.int32)
            next_block += size
            want = [ref.setdefault(k, b) for k, b in zip(keys.tolist(), blocks.tolist())]
            got = index.claim(keys, blocks)
            if want == blocks.tolist():
                assert got is None or got.tolist() == want
            else:
                assert got is not None and got.tolist() == want
            assert index.as_dict() == ref and len(index) == len(ref)
            probe = rng.choice(pool, 20)
            assert index.get_many(probe).tolist() == [ref.get(k, -1) for k in probe.tolist()]


def test_claims_answer_as_dict_setdefault_growing_by_copies(monkeypatch):
    """Where the array cannot grow where it lies (no mremap), it is copied: the same
    answers."""
    from labkit.engine import small_pages

    monkeypatch.setattr(small_pages, "grow_in_place", lambda owner, name, count: False)
    test_claims_answer_as_dict_setdefault()


def _claim_apart(index, first, n, block=0):
    index.claim(np.arange(first, first + n, dtype=np.int64),
                np.arange(block, block + n, dtype=np.int32))


def test_the_array_grows_where_it_lies(monkeypatch):
    """Past its first size the array grows without a copy (each copy scanned it and
    wrote every held key's page again: half an agentic replay's page faults)."""
    def no_copy(self, size):
        raise AssertionError("copied")

    monkeypatch.setattr(KeyIndex, "_grow_by_copying", no_copy)
    index = KeyIndex()
    for step, first in enumerate((1 << 14, 1 << 20, 1 << 23)):  # 4096 -> 32768 -> ...
        _claim_apart(index, first, 20, block=20 * step)
    assert len(index.slot) >= (1 << 23) + 20 and len(index) == 60
    # no larger than the keys need: a process that forks is charged for all of it
    # (room for every key taken up front kept test workers from starting subprocesses)
    assert len(index.slot) <= 1 << 24 and len(index.slot.base.obj) == 4 * len(index.slot)
    assert index.get_many(np.arange(1 << 20, (1 << 20) + 20)).tolist() == list(range(20, 40))
    assert index.as_dict() == {first + i: 20 * step + i for step, first in
                               enumerate((1 << 14, 1 << 20, 1 << 23)) for i in range(20)}


def test_an_array_seen_from_elsewhere_is_copied():
    """A view of the array pins its memory: then it grows by a copy, and the view still
    reads what it read."""
    index = KeyIndex()
    _claim_apart(index, 1 << 14, 20)
    seen = index.slot[1 << 14 : (1 << 14) + 20]
    _claim_apart(index, 1 << 20, 2, block=20)
    assert not np.shares_memory(seen, index.slot) and seen.tolist() == list(range(1, 21))
    assert index.get((1 << 20) + 1) == 21 and index.get((1 << 14) + 3) == 3
