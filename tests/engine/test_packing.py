"""Per-layer vs packed KV layout: descriptors per block, and internal fragmentation."""

import numpy as np
import pytest

from labkit import Engine, capacity
from labkit.engine.kv import KVManager, TraceBlockKeys
from labkit.engine.kv.packing import block_layout
from labkit.engine.request import Request
from labkit.errors import ConfigError
from tests.support import small_agentx


@pytest.mark.parametrize("model, layout, buffers", [
    ("llama-3.1-8b", "tp1", 32 * 2),  # K and V of 32 layers
    ("llama-3.1-8b", "tp4xpp2", 16 * 2),  # a stage holds half the layers
    ("deepseek-v3", "tp8", 61),  # one latent per layer (MTP not served)
    ("deepseek-v3.2", "dcp8", 61 * 2),  # latent + indexer keys
])
def test_descriptors_per_block(model, layout, buffers):
    engine = Engine(model, layout, "h200")
    per_layer = block_layout(engine.placement, 64, "per_layer")
    packed = block_layout(engine.placement, 64, "packed")
    assert per_layer.descriptors_per_block == buffers
    assert packed.descriptors_per_block == 1
    assert per_layer.block_bytes == packed.block_bytes == \
        64 * engine.placement.kv_bytes_per_token_per_gpu()
    assert per_layer.bytes_per_descriptor * buffers == pytest.approx(per_layer.block_bytes)
    assert packed.copy_overhead_s(100) * buffers == pytest.approx(per_layer.copy_overhead_s(100))


def test_capacity_reports_the_layout():
    a = capacity("deepseek-v3", "tp8", "h200", context=100_000)
    b = capacity("deepseek-v3", "tp8", "h200", context=100_000, kv_layout="packed")
    assert (a["kv_layout"], a["kv_descriptors_per_block"]) == ("per_layer", 61)
    assert (b["kv_layout"], b["kv_descriptors_per_block"]) == ("packed", 1)
    assert a["kv_capacity_tokens_per_gpu"] == b["kv_capacity_tokens_per_gpu"]
    with pytest.raises(ConfigError, match="per_layer"):
        capacity("deepseek-v3", "tp8", "h200", context=1000, kv_layout="dense")


def test_internal_fragmentation_counts_the_empty_slots_of_finished_calls():
    kv = KVManager(64, 4)
    req = Request("a", "s", 17, 4, 0.0)
    req.keys = TraceBlockKeys(np.arange(10, 15, dtype=np.int64), 4, 4)
    assert kv.allocate(req, 21)
    req.num_computed_tokens = 21
    req.finish_s = 1.0
    kv.free(req)
    assert (kv.slots_allocated, kv.slots_used) == (24, 21)  # 6 blocks of 4, 21 tokens


def test_larger_blocks_waste_more():
    trace = small_agentx(6, seed=2)
    frag = {bs: Engine("llama-3.1-8b", "tp1", "h200", block_size=bs).replay(
        trace, concurrency=6, duration_s=30).summary["kv_internal_fragmentation"]
        for bs in (16, 64)}
    assert 0 < frag[16] < frag[64] < 0.2
