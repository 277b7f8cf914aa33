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
    tiers, _ = replay_agentic("tiny-llama", layout, short=True, cpu_kv_gib=12 * gib,
                              disk_kv_gib=200 * gib, kv_offload_dir=str(tmp_path))
    plain, _ = replay_agentic("tiny-llama", layout, short=True)
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


def test_a_corrupt_block_on_disk_is_recomputed_instead(tmp_path):
    """A prompt's KV is pushed down to the disk tier; one of its block files is then
    damaged. The next call loads the blocks before it, recomputes from it on, and
    generates exactly what greedy decoding gives."""
    from compute_cases import assert_greedy

    from labkit.engine.events import KVLoaded

    gib = block_gib("tiny-llama", "tp1")
    eng = compute_engine("tiny-llama", "tp1", num_gpu_blocks_override=24,
                         cpu_kv_gib=4 * gib, disk_kv_gib=64 * gib,
                         kv_offload_dir=str(tmp_path))
    loads = []
    eng.events.subscribe(loads.append, KVLoaded)
    vocab = get_model("tiny-llama").vocab_size
    prompt = [(7 * i) % (vocab - 4) + 4 for i in range(160)]  # 10 blocks
    eng.submit_prompt(prompt, 2, request_id="first")
    run_to_end(eng)
    for i in range(3):  # other traffic: the prompt's blocks leave the GPU and the CPU
        eng.submit_prompt([(11 * j + i) % (vocab - 4) + 4 for j in range(150)], 2,
                          request_id=f"other{i}")
        run_to_end(eng)
    keys = eng.requests["first"].keys
    disk = eng.data_plane.tiers.disk(0)
    on_disk = [j for j in range(10) if keys.key(j) in disk]
    assert len(on_disk) >= 6
    bad = on_disk[3]
    path = disk.path(keys.key(bad))
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF
    path.write_bytes(bytes(raw))
    eng.submit_prompt(prompt + [5, 6, 7], 3, request_id="again")
    run_to_end(eng)
    again = eng.requests["again"]
    assert [e.request_id for e in loads] == ["again"]
    # the load stops right before the damaged block: the rest is recomputed
    assert again.num_cached_tokens == bad * eng.block_size
    assert eng.offload.summary()["disk_tier_corrupt_blocks"] == 1
    # the damaged file is gone (a recomputed copy of the block may be written anew)
    assert not path.exists() or disk.read(keys.key(bad)) is not None
    store = eng.offload.stores[0]
    assert sorted(disk.keys()) == sorted(store.tiers[1].policy.resident())
    assert assert_greedy("tiny-llama", eng) == 5


def test_a_sliding_window_replay_through_the_tiers_generates_the_same_tokens(tmp_path):
    """tiny-gpt-oss: window pages go to the tiers with the blocks and come back with a
    loaded prefix; the tokens are those of a run without tiers."""
    gib = block_gib("tiny-gpt-oss", "tp1")
    knobs = dict(sessions=2, num_gpu_blocks_override=32, max_num_batched_tokens=48)
    tiers, _ = replay_agentic("tiny-gpt-oss", "tp1", cpu_kv_gib=6 * gib,
                              disk_kv_gib=200 * gib, kv_offload_dir=str(tmp_path), **knobs)
    plain, _ = replay_agentic("tiny-gpt-oss", "tp1", **knobs)
    assert sum(r.num_offload_tokens for r in tiers.requests.values()) > 0
    assert tiers.offload.summary()["disk_tier_hit_blocks"] > 0
    assert outputs(tiers) == outputs(plain)
