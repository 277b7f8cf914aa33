"""KV offload tiers on the compute plane: the bytes really move, and come back exact."""

from __future__ import annotations

import pytest
import torch
from compute_cases import compute_engine, outputs, replay_agentic, run_to_end, \
    shared_prefix_prompts, submit_prompts

from labkit.engine.compute.tier_bytes import TierCorruption
from labkit.engine.kv.tiers import Move
from labkit.specs import get_model

GIB = 2**30


def block_gib(model: str, layout: str) -> float:
    eng = compute_engine(model, layout)
    return eng.block_size * eng.placement.kv_bytes_per_token() / GIB


def warm_engine(model: str, layout: str, tmp_path, **knobs):
    """An engine whose GPU blocks hold real KV (a few prompts have run)."""
    eng = compute_engine(model, layout, cpu_kv_gib=64 * block_gib(model, layout),
                         disk_kv_gib=64 * block_gib(model, layout),
                         kv_offload_dir=str(tmp_path), **knobs)
    submit_prompts(eng, shared_prefix_prompts(get_model(model).vocab_size), 4)
    return run_to_end(eng)


def same_bytes(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("model, layout", [
    ("tiny-llama", "tp1"), ("tiny-llama", "tp4xdcp2"), ("tiny-llama", "pp2"),
    ("tiny-deepseek-v3", "tp2"), ("tiny-deepseek-v3.2", "dcp2"),
])
def test_kv_bytes_are_identical_after_a_round_trip_through_cpu_and_disk(model, layout,
                                                                         tmp_path):
    eng = warm_engine(model, layout, tmp_path)
    tiers = eng.data_plane.tiers
    src, dst, key = 1, 7, 0x1234_5678_9ABC  # GPU blocks of DP rank 0 the prompts filled
    original = tiers.read_gpu(0, src)
    assert any(t.abs().sum() > 0 for t in original.values())  # real KV, not zeros
    tiers(0, [Move("store", key, "cpu", 0, src), Move("demote", key, "cpu")])
    assert key not in tiers.host[0] and tiers.disk(0).path(key).is_file()
    for rank in eng.data_plane.ranks:  # the GPU forgets the block entirely
        for named in rank.kv.layers.values():
            for t in named.values():
                t[src] = 0
                t[dst] = float("nan")
    tiers(0, [Move("load", key, "disk", 0, dst)])
    assert same_bytes(tiers.read_gpu(0, dst), original)
    tiers(0, [Move("store", key, "cpu", 0, dst), Move("discard", key, "disk"),
              Move("load", key, "cpu", 0, src)])
    assert same_bytes(tiers.read_gpu(0, src), original)
    assert not tiers.disk(0).path(key).exists()


def test_a_corrupt_block_file_is_never_served(tmp_path):
    eng = warm_engine("tiny-llama", "tp1", tmp_path)
    tiers = eng.data_plane.tiers
    key = 99
    tiers(0, [Move("store", key, "cpu", 0, 1), Move("demote", key, "cpu")])
    path = tiers.disk(0).path(key)
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF  # one flipped bit of the payload
    path.write_bytes(bytes(raw))
    before = tiers.read_gpu(0, 3)
    with pytest.raises(TierCorruption, match="checksum"):
        tiers(0, [Move("load", key, "disk", 0, 3)])
    assert same_bytes(tiers.read_gpu(0, 3), before)  # the GPU block was not touched
    assert not path.exists()


@pytest.mark.parametrize("layout", ["tp1", "dp2"])
def test_an_agentic_replay_through_the_tiers_generates_the_same_tokens(layout, tmp_path):
    gib = block_gib("tiny-llama", layout)
    tiers, _ = replay_agentic("tiny-llama", layout, cpu_kv_gib=12 * gib,
                              disk_kv_gib=200 * gib, kv_offload_dir=str(tmp_path))
    plain, _ = replay_agentic("tiny-llama", layout)
    loaded = sum(r.num_offload_tokens for r in tiers.requests.values())
    stats = tiers.offload.summary()
    assert loaded > 0 and stats["disk_tier_hit_blocks"] > 0 and stats["cpu_tier_hit_blocks"] > 0
    assert outputs(tiers) == outputs(plain)
    # the files and host tensors are exactly what the control plane accounts for
    for store in tiers.offload.stores:
        cpu, disk = store.tiers
        assert len(tiers.data_plane.tiers.host.get(store.index, {})) == len(cpu)
        assert len(tiers.data_plane.tiers.disk(store.index).keys()) == len(disk)
        assert sorted(tiers.data_plane.tiers.disk(store.index).keys()) == \
            sorted(disk.policy.resident())
