"""HiSparse (sparse decode from a host pool): selection, buffer hits, bytes, capacity."""

import math

import pytest

from labkit import Engine, generate_agentx_trace
from labkit.engine.kv.packing import DMA_DESCRIPTOR_S
from labkit.engine.step_io import RankStep
from labkit.engine.sim.hisparse import (
    CHURN, HOST_SHARE, HiSparse, index_bytes_per_token_per_gpu, latent_bytes_per_token_per_gpu)
from labkit.errors import ConfigError

GIB = 2**30


def engine(**knobs):
    return Engine("deepseek-v3.2", "dcp8", "h200", kv_cache_dtype="fp8",
                  hisparse_buffer_tokens=knobs.pop("buffer", 4096), **knobs)


def model_of(e) -> HiSparse:
    return e.hisparse


def test_the_selection_is_sink_hot_blocks_and_the_recent_window():
    hs = model_of(engine())
    k = hs.topk_blocks
    assert hs.select("short", k - 3) == list(range(k - 3))  # small contexts: dense
    n = 40 * k
    first = hs.select("r", n)
    assert len(first) == k and len(set(first)) == k and first[0] == 0
    assert first[-hs.local_blocks:] == list(range(n - hs.local_blocks, n))
    second = hs.select("r", n)
    changed = len(set(first) - set(second))
    assert changed == max(1, round(CHURN * hs.hot_count))
    again = model_of(engine())  # same seed, same request: the same draws
    assert again.select("r", n) == first and again.select("r", n) == second


def test_buffer_hits_and_the_bytes_and_seconds_of_the_misses():
    e = engine()
    hs = model_of(e)
    batch = RankStep(0, ["r"], [1], [50_000], [True])  # one decode after 50k tokens
    cold = hs.rank_seconds(batch)
    selected = hs.stats.selected_blocks
    assert hs.stats.hit_blocks == 0 and hs.stats.loaded_blocks == selected == hs.topk_blocks
    warm_before = hs.stats.loaded_blocks
    warm = hs.rank_seconds(batch)
    misses = hs.stats.loaded_blocks - warm_before
    assert misses == max(1, round(CHURN * hs.hot_count))  # the churned hot blocks
    hw = e.hardware
    block_bytes = e.block_size * latent_bytes_per_token_per_gpu(e.placement)
    expected = hw.host_link_latency_s + misses * block_bytes / hw.pcie_bandwidth \
        + misses * e.block_layout.descriptors_per_block * DMA_DESCRIPTOR_S
    assert warm == pytest.approx(expected, rel=1e-12) and cold > 10 * warm
    assert hs.stats.bytes_moved == pytest.approx(hs.stats.loaded_blocks * block_bytes)


def test_the_gpu_holds_indexer_keys_and_buffers_so_far_more_context_fits():
    plain = Engine("deepseek-v3.2", "dcp8", "h200", kv_cache_dtype="fp8")
    e = engine()
    p, hw, cfg = e.placement, e.hardware, e.config
    host = HOST_SHARE * hw.host_memory_bytes / hw.gpus_per_node
    host_blocks = int(host // (e.block_size * latent_bytes_per_token_per_gpu(p)))
    buffers = cfg.max_num_seqs * 4096 * latent_bytes_per_token_per_gpu(p)
    gpu_blocks = int((e.capacity.available_bytes_per_gpu - buffers)
                     // (e.block_size * index_bytes_per_token_per_gpu(p)))
    assert e.num_blocks == min(host_blocks, gpu_blocks) > 3 * plain.num_blocks
    assert index_bytes_per_token_per_gpu(p) + latent_bytes_per_token_per_gpu(p) == \
        pytest.approx(p.kv_bytes_per_token_per_gpu())


def test_a_replay_pays_for_its_copies():
    trace = generate_agentx_trace(2, seed=1, context_window_tokens=60_000,
                                  compact_threshold_tokens=40_000)
    base = Engine("deepseek-v3.2", "dcp8", "h200", kv_cache_dtype="fp8").replay(
        trace, concurrency=2, duration_s=60)
    e = engine()
    r = e.replay(trace, concurrency=2, duration_s=60)
    s = r.summary
    assert 0.5 < s["hisparse_hit_rate"] < 1.0
    assert s["hisparse_decode_loaded_blocks"] > 0 and s["hisparse_prefill_streamed_blocks"] > 0
    assert s["hisparse_load_s"] <= r.steps["busy_s"].sum()
    assert s["tpot_p50_s"] > base.summary["tpot_p50_s"]  # decode steps wait for PCIe
    assert math.isclose(s["hisparse_bytes_moved"], (s["hisparse_decode_loaded_blocks"]
                        + s["hisparse_prefill_streamed_blocks"]) * e.block_size
                        * latent_bytes_per_token_per_gpu(e.placement))


@pytest.mark.parametrize("model, knobs, words", [
    ("deepseek-v3", dict(hisparse_buffer_tokens=4096), ["sparse indexer", "deepseek-v3"]),
    ("deepseek-v3.2", dict(hisparse_buffer_tokens=1024), ["index_topk", "2048"]),
    ("deepseek-v3.2", dict(hisparse_buffer_tokens=-1), [">= 0"]),
    ("deepseek-v3.2", dict(hisparse_buffer_tokens=4096, max_num_seqs=100_000),
     ["no GPU memory"]),
])
def test_bad_hisparse_settings_are_refused(model, knobs, words):
    with pytest.raises(ConfigError) as err:
        Engine(model, "dcp8", "h200", kv_cache_dtype="fp8", **knobs)
    for w in words:
        assert w in str(err.value)


def test_hisparse_is_a_sim_plane_model():
    with pytest.raises(ConfigError, match="sim plane only"):
        Engine("tiny-deepseek-v3.2", "tp1", backend="compute", hisparse_buffer_tokens=4096)
