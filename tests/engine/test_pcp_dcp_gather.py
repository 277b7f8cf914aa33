"""PCPxDCP prefill: each layer all-gathers the cached prefix's DCP shards into a
temporary full copy for the rank's queries — bytes and time of that gather."""

import pytest

from labkit.costmodel import CostModel
from labkit.engine.layouts import Placement
from labkit.specs import Layout, get_model


def test_the_gather_moves_the_whole_prefix_once_per_layer():
    m = get_model("deepseek-v3")
    pcp_dcp = Placement(m, Layout.parse("pcp8xdcp8"))
    per_token = pcp_dcp.kv_bytes_per_token_per_layer_per_gpu()
    assert per_token == (512 + 64) * 2  # one bf16 latent per token per layer
    comm = pcp_dcp.comm_per_layer(256, new_kv_tokens=2048, prefill_prefix_tokens=32768,
                                  sharded_query_tokens=0)
    assert comm["dcp_gather_prefix"] == ("all_gather", 32768 * per_token, 8)
    assert comm["pcp_gather_kv"] == ("all_gather", 2048 * per_token, 8)
    # PCP alone keeps the full KV on every rank: nothing to gather but the chunk's KV
    pcp = Placement(m, Layout.parse("pcp8")).comm_per_layer(
        256, new_kv_tokens=2048, prefill_prefix_tokens=32768, sharded_query_tokens=0)
    assert "dcp_gather_prefix" not in pcp
    # GQA models too (the shards of every KV head)
    g = Placement(get_model("llama-3.1-8b"), Layout.parse("pcp2xdcp2xtp2"))
    assert "dcp_gather_prefix" in g.comm_per_layer(64, 128, 0, 4096, 0)


@pytest.mark.parametrize("context", [8192, 65536])
def test_prefill_step_pays_the_gather_per_layer(context):
    """A 2K chunk: communication with a cached prefix minus without = layers x the
    all-gather of the prefix's latents over the 8 DCP GPUs."""
    cm = CostModel("h200")
    m = get_model("deepseek-v3")
    chunk = lambda ctx: cm.step_time("deepseek-v3", "pcp8xdcp8",  # noqa: E731
                                     [{"new_tokens": 2048, "context": ctx, "decode": False}])
    gathered = chunk(context)["comm_s"] - chunk(0)["comm_s"]
    per_layer = cm.collective("all_gather", context * (512 + 64) * 2, 8)
    assert gathered == pytest.approx(m.num_layers * per_layer, rel=1e-9)
