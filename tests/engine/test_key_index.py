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


def test_claims_answer_as_dict_setdefault_without_reserved_room(monkeypatch):
    """Where the system lends no room for every key at once, the array grows by copying
    (`_reserve` gives None): the same answers."""
    from labkit.engine.kv import key_index

    monkeypatch.setattr(key_index, "_reserve", lambda: None)
    test_claims_answer_as_dict_setdefault()


def test_growing_keeps_the_keys_where_they_are():
    """Past its first size the array grows as a longer view of room taken once: what it
    holds is not copied (each copy wrote every held key's page again)."""
    index = KeyIndex()
    index.claim(np.arange(1 << 14, (1 << 14) + 20, dtype=np.int64), np.arange(20, dtype=np.int32))
    before = index.slot
    index.claim(np.array([1 << 20, (1 << 20) + 1], dtype=np.int64), np.array([20, 21], np.int32))
    assert len(index.slot) > len(before) and np.shares_memory(index.slot, before)
    assert index.get_many(np.arange(1 << 14, (1 << 14) + 20)).tolist() == list(range(20))
    assert index.get((1 << 20) + 1) == 21 and len(index) == 22
