"""Offload tiers (`kv/tiers.py`): accounting that conserves blocks and bytes.

The reference is a naive mirror: a dict per tier that applies every `Move` the store
reports, the way a data plane would copy bytes. After any sequence of stores and
loads, the mirror, the eviction policies and the statistics must all agree.
"""

from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.engine.kv.tiers import NodeStore, Tier

BLOCK_BYTES = 4096.0
PER_GPU = 1024.0


def make_store(cpu: int, disk: int, policy: str) -> NodeStore:
    tiers = [Tier("cpu", cpu, 64e9, 10e-6, policy)]
    if disk:
        tiers.append(Tier("disk", disk, 8e9, 100e-6, policy))
    return NodeStore(0, tiers, BLOCK_BYTES, PER_GPU)


class Mirror:
    """What a data plane holds if it applies the moves in order: tier -> {key: bytes},
    and GPU block -> the key whose bytes it holds."""

    def __init__(self, names):
        self.tiers = {n: {} for n in names}
        self.below = dict(zip(names, names[1:]))
        self.gpu: dict[tuple[int, int], int] = {}

    def apply(self, m):
        tier = self.tiers[m.tier]
        if m.kind == "store":
            key_on_gpu = self.gpu[(m.rank, m.block)]
            assert key_on_gpu == m.key, "stored from a GPU block holding other bytes"
            assert m.key not in tier, "a block stored twice into one tier"
            tier[m.key] = f"kv{m.key}"
        elif m.kind == "demote":
            below = self.tiers[self.below[m.tier]]
            assert m.key not in below
            below[m.key] = tier.pop(m.key)
        elif m.kind in ("drop", "discard"):
            del tier[m.key]
        elif m.kind == "load":
            assert tier[m.key] == f"kv{m.key}", "loaded bytes that are not the block's"
            self.gpu[(m.rank, m.block)] = m.key
        else:
            raise AssertionError(m.kind)


ops = st.lists(st.tuples(st.sampled_from(["store", "load"]),
                         st.lists(st.integers(0, 40), min_size=1, max_size=12, unique=True)),
               min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=ops, cpu=st.integers(1, 12), disk=st.integers(0, 20),
       policy=st.sampled_from(["lru", "arc"]))
def test_moves_statistics_and_policies_agree(ops, cpu, disk, policy):
    store = make_store(cpu, disk, policy)
    mirror = Mirror([t.name for t in store.tiers])
    next_block = iter(range(10**6))
    loaded = 0
    for kind, keys in ops:
        if kind == "store":
            blocks = [next(next_block) for _ in keys]
            for k, b in zip(keys, blocks):
                mirror.gpu[(0, b)] = k  # the GPU computed these blocks
            moves = store.store(keys, 0, blocks)
        else:
            found = store.locate(keys)
            run = keys[:len(found)]
            moves = store.take(run, 0, [next(next_block) for _ in run])
            loaded += len(run)
            assert [m.key for m in moves if m.kind == "load"] == run
        for m in moves:
            mirror.apply(m)
        for tier in store.tiers:
            held = mirror.tiers[tier.name]
            assert set(held) == set(tier.policy.resident())  # blocks conserved
            assert tier.stats.resident() == len(held) <= tier.capacity_blocks
        # one copy per node: no key in two tiers; locate sees exactly the mirror
        names = [set(h) for h in mirror.tiers.values()]
        assert sum(map(len, names)) == len(set().union(*names))
        everything = sorted(set().union(*names))
        assert len(store.locate(everything)) == len(everything)
    stats = store.stats()
    cpu_stats = stats["cpu"]
    assert sum(s.hit_blocks for s in stats.values()) == loaded
    if disk:
        d = stats["disk"]
        # the disk receives exactly what the CPU tier evicts, and the CPU drops nothing
        assert d.stored_blocks == cpu_stats.evicted_blocks
        assert cpu_stats.dropped_blocks == 0
        assert d.evicted_blocks == d.dropped_blocks
    else:
        assert cpu_stats.evicted_blocks == cpu_stats.dropped_blocks
    # bytes: what is resident is exactly what was written and not let go of
    for tier in store.tiers:
        s = tier.stats
        written = s.stored_blocks * BLOCK_BYTES
        gone = (s.evicted_blocks + s.promoted_blocks) * BLOCK_BYTES
        assert written - gone == len(mirror.tiers[tier.name]) * BLOCK_BYTES


def test_load_time_is_latency_plus_bytes_over_each_link():
    store = make_store(4, 8, "lru")
    store.store(range(10), 0, range(10))  # 6 blocks spill to disk
    levels = store.locate(list(range(10)))
    assert levels.count(0) == 4 and levels.count(1) == 6
    cpu, disk = store.tiers
    expected = (cpu.latency_s + 10 * PER_GPU / cpu.bandwidth
                + disk.latency_s + 6 * BLOCK_BYTES / disk.bandwidth)
    assert abs(store.load_seconds(levels) - expected) < 1e-15
    assert store.load_seconds([]) == 0.0
    assert store.load_seconds([0, 0]) == cpu.latency_s + 2 * PER_GPU / cpu.bandwidth


def test_locate_stops_at_the_first_miss_and_a_load_from_disk_promotes():
    store = make_store(2, 4, "lru")
    store.store([1, 2, 3, 4], 0, [10, 11, 12, 13])  # cpu: 3, 4 ; disk: 1, 2
    assert store.locate([3, 4, 9, 1]) == [0, 0]
    assert store.locate([1, 2, 3]) == [1, 1, 0]
    moves = store.take([1, 2], 0, [20, 21])
    kinds = [(m.kind, m.key, m.tier) for m in moves]
    # both loads happen before any promotion pushes blocks around
    assert kinds[:2] == [("load", 1, "disk"), ("load", 2, "disk")]
    assert ("discard", 1, "disk") in kinds and ("demote", 3, "cpu") in kinds
    assert store.locate([1, 2]) == [0, 0] and store.locate([3, 4]) == [1, 1]
    assert store.stats()["disk"].promoted_blocks == 2


def test_a_stored_key_already_resident_is_only_touched():
    store = make_store(2, 0, "lru")
    assert [m.kind for m in store.store([1, 2], 0, [0, 1])] == ["store", "store"]
    assert store.store([1], 0, [5]) == []  # 1 becomes most recent
    moves = store.store([3], 0, [2])
    assert [(m.kind, m.key) for m in moves] == [("store", 3), ("drop", 2)]
