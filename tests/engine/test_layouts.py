"""Who holds what: KV and weight arithmetic of every layout against closed forms.

Each expected value is written out from the model's published dimensions (DESIGN.md
§5), not computed by calling labkit's own helpers.
"""

import math

import pytest

from labkit.engine.capacity import capacity
from labkit.engine.layouts import Placement, dcp_shard_tokens
from labkit.errors import ConfigError
from labkit.specs import Layout, get_model

DSV3 = get_model("deepseek-v3")
L70 = get_model("llama-3.1-70b")
L8 = get_model("llama-3.1-8b")
N = 131_072  # tokens of the request

MLA_LAYER = (512 + 64) * 2  # bytes per token per layer, bf16 latent
GQA70_LAYER_HEAD = 2 * 128 * 2  # K and V of one head, bf16


def place(model, layout, **kw):
    return Placement(model, Layout.parse(layout), **kw)


# --------------------------------------------------------------- persistent KV
@pytest.mark.parametrize("layout,expected", [
    ("tp1", N * 80 * 8 * GQA70_LAYER_HEAD),          # all 8 KV heads, 80 layers
    ("dp4", N * 80 * 8 * GQA70_LAYER_HEAD),          # DP: the request lives on one GPU
    ("tp2", N * 80 * 4 * GQA70_LAYER_HEAD),          # 8 heads / 2
    ("tp8", N * 80 * 1 * GQA70_LAYER_HEAD),          # one head each
    ("tp16", N * 80 * 1 * GQA70_LAYER_HEAD),         # replicated: still one head each
    ("tp16xdcp2", N // 2 * 80 * GQA70_LAYER_HEAD),   # DCP removes the 2x replication
    ("tp4xpp2", N * 40 * 2 * GQA70_LAYER_HEAD),      # 40 layers a stage, 2 heads
    ("pcp2xtp4", N * 80 * 2 * GQA70_LAYER_HEAD),     # PCP keeps a full copy per rank
])
def test_gqa_persistent_kv(layout, expected):
    assert place(L70, layout).persistent_kv_bytes_per_gpu(N) == expected


@pytest.mark.parametrize("layout,expected", [
    ("tp8", N * 61 * MLA_LAYER),             # the latent is replicated on all 8 ranks
    ("dep16", N * 61 * MLA_LAYER),           # DP attention: the whole request on one rank
    ("tp8xdcp8", N // 8 * 61 * MLA_LAYER),   # token shards
    ("tp8xdcp4", N // 4 * 61 * MLA_LAYER),
    ("pcp8", N * 61 * MLA_LAYER),            # PCP alone: gathered, a full copy per rank
    ("pcp8xdcp8xep8", N // 8 * 61 * MLA_LAYER),  # PCPxDCP: each keeps 1/8
    ("tp8xkvpp8", N * 8 * MLA_LAYER),        # ceil(61 / 8) layers each
    ("tp4xpp2", N * 31 * MLA_LAYER),         # ceil(61 / 2) layers on the larger stage
])
def test_mla_persistent_kv(layout, expected):
    assert place(DSV3, layout).persistent_kv_bytes_per_gpu(N) == expected


def test_fp8_kv_halves_mla():
    assert place(DSV3, "tp8", kv_dtype="fp8").persistent_kv_bytes_per_gpu(N) == N * 61 * 576


@pytest.mark.parametrize("tokens,dcp,interleave", [
    (100, 8, 1), (100, 8, 16), (131_072, 8, 1), (1_000_003, 4, 64), (5, 8, 1), (7, 2, 4)])
def test_dcp_interleaving_is_exact(tokens, dcp, interleave):
    owner = [(i // interleave) % dcp for i in range(tokens)] if tokens < 10_000 else None
    shards = [dcp_shard_tokens(tokens, dcp, interleave, r) for r in range(dcp)]
    assert sum(shards) == tokens
    if owner is not None:
        assert shards == [owner.count(r) for r in range(dcp)]
    assert max(shards) - min(shards) <= interleave  # balanced to one interleave


def test_dcp_interleave_changes_the_largest_shard():
    p1 = place(DSV3, "tp8xdcp8", dcp_interleave=1)
    p64 = place(DSV3, "tp8xdcp8", dcp_interleave=64)
    tokens = 8 * 64 * 10 + 100  # 100 tokens past a full cycle of 64-token runs
    assert p1.persistent_kv_bytes_per_gpu(tokens) == math.ceil(tokens / 8) * 61 * MLA_LAYER
    assert p64.persistent_kv_bytes_per_gpu(tokens) == (64 * 10 + 64) * 61 * MLA_LAYER


# ---------------------------------------------------------------- temporary KV
@pytest.mark.parametrize("model,layout,expected", [
    (DSV3, "tp8", 0), (DSV3, "pcp8", 0), (DSV3, "dep16", 0),
    (DSV3, "pcp8xdcp8xep8", N * MLA_LAYER),  # one layer's KV gathered for the local queries
    (DSV3, "tp8xkvpp8", N * MLA_LAYER),      # one layer broadcast from its owner
    (DSV3, "tp8xdcp8", N * MLA_LAYER),       # MLA prefill gathers the prefix's latents
    (get_model("deepseek-v3.2"), "tp8xdcp8", 0),  # ...which DSA's absorbed path does not
    (L70, "tp16xdcp2", 0),                    # nor does GQA
])
def test_temporary_kv(model, layout, expected):
    assert place(model, layout).temporary_kv_bytes_per_gpu(N) == expected


def test_linear_attention_state_is_per_sequence():
    kimi = get_model("kimi-linear-48b-a3b")
    per_layer = 32 * 128 * 128 * 4 + 3 * 3 * 32 * 128 * 2  # fp32 state + conv history
    state = 20 * per_layer
    mla_kv = N * 7 * MLA_LAYER  # 7 MLA layers hold per-token KV
    assert place(kimi, "tp1").persistent_kv_bytes_per_gpu(N) == mla_kv + state
    assert place(kimi, "tp4").persistent_kv_bytes_per_gpu(N) == mla_kv + state / 4


# --------------------------------------------------------------------- weights
def test_llama_weights_under_tp_and_pp():
    h, v, inter, layers = 8192, 128256, 28672, 80
    attn = 2 * h * 64 * 128 + 2 * h * 8 * 128  # q, o + k, v
    mlp = 3 * h * inter
    emb = 2 * v * h * 2  # embedding + LM head, bf16
    assert place(L70, "tp1").weights_bytes_per_gpu() == pytest.approx(
        layers * (attn + mlp) * 2 + emb)
    assert place(L70, "tp8").weights_bytes_per_gpu() == pytest.approx(
        layers * (attn + mlp) * 2 / 8 + emb / 8)
    # pp2: 40 layers a stage, the last stage keeps only the LM head
    assert place(L70, "tp4xpp2").weights_bytes_per_gpu() == pytest.approx(
        40 * (attn + mlp) * 2 / 4 + v * h * 2 / 4)
    # tp16 replicates KV heads: each rank keeps one K and one V head projection
    assert place(L70, "tp16").weights_bytes_per_gpu() == pytest.approx(
        layers * ((2 * h * 64 * 128) / 16 + 2 * h * 128 + mlp / 16) * 2 + emb / 16)


def test_deepseek_weights_under_tp_and_dep():
    h, q_lora, kv_lora, heads, v = 7168, 1536, 512, 128, 129280
    replicated = h * q_lora + h * (kv_lora + 64)  # q_a and kv_a: not per head
    per_head = q_lora * heads * 192 + kv_lora * heads * (128 + 128) + heads * 128 * h
    expert = 3 * h * 2048
    moe = 256 * expert  # routed
    shared = expert
    router = h * 256
    dense_mlp = 3 * h * 18432
    emb = 2 * v * h * 2

    def total(tp, expert_group):
        attn = replicated + per_head / tp
        dense_layers = 3 * (attn + dense_mlp / tp)
        moe_layers = 58 * (attn + moe / expert_group + shared / tp + router)
        return (dense_layers + moe_layers) * 1 + emb / tp  # fp8 weights, bf16 embeddings

    assert place(DSV3, "tp8").weights_bytes_per_gpu() == pytest.approx(total(8, 8))
    assert place(DSV3, "dep16").weights_bytes_per_gpu() == pytest.approx(total(1, 16))
    assert place(DSV3, "tp8xep8").weights_bytes_per_gpu() == pytest.approx(total(8, 8))
    assert place(DSV3, "pcp8xdcp8xep8").weights_bytes_per_gpu() == pytest.approx(total(1, 8))


# -------------------------------------------------------------- communication
def test_collectives_per_layer():
    p = place(DSV3, "tp8xdcp8")
    comm = p.comm_per_layer(tokens=64)
    assert comm["tp_allreduce"] == ("all_reduce", 64 * 7168 * 2, 8)
    # all-gather output: the queries of all 8 x 16 heads it shares KV with
    assert comm["dcp_gather_q"] == ("all_gather", 64 * 16 * 8 * 576 * 2, 8)
    assert comm["dcp_merge"] == ("reduce_scatter", 64 * 128 * (512 * 2 + 4), 8)
    dep = place(DSV3, "dep16").moe_comm(tokens=10)
    assert dep["ep_dispatch"] == ("all_to_all", 10 * 8 * 7168 * 1, 16)
    assert dep["ep_combine"] == ("all_to_all", 10 * 8 * 7168 * 2, 16)
    pcp = place(DSV3, "pcp8xdcp8xep8").comm_per_layer(tokens=512, new_kv_tokens=4096)
    assert pcp["pcp_gather_kv"] == ("all_gather", 4096 * MLA_LAYER, 8)  # output: all new KV
    assert "tp_allreduce" not in place(DSV3, "dep16").comm_per_layer(tokens=10)
    # PCPxDCP: the DCP group is PCP ranks that already hold every head: no query
    # gather, and every rank keeps the merged output (all-reduce of 128 heads)
    both = place(DSV3, "pcp8xdcp8xep8").comm_per_layer(tokens=16)
    assert "dcp_gather_q" not in both
    assert both["dcp_merge"] == ("all_reduce", 16 * 128 * (512 * 2 + 4), 8)
    # Kimi-K2 tp16xdcp8: 4 heads a rank, KV shared by groups of 8 TP ranks
    k2 = place(get_model("kimi-k2"), "tp16xdcp8").comm_per_layer(tokens=2)
    assert k2["dcp_gather_q"] == ("all_gather", 2 * 32 * 576 * 2, 8)
    assert k2["dcp_merge"] == ("reduce_scatter", 2 * 32 * (512 * 2 + 4), 8)


# ---------------------------------------------------------------- bad layouts
@pytest.mark.parametrize("model,layout,words", [
    (L8, "tp8xdcp2", ["dcp2", "kv_heads"]),          # GQA with no replication to remove
    (L70, "tp16xdcp4", ["dcp4"]),                     # only 2x replication at tp16
    (DSV3, "tp3", ["tp3", "heads"]),
    (L8, "dep8", ["ep", "dense"]),
    (DSV3, "tp8xep3", ["ep3"]),
    (DSV3, "tp8xkvpp3", ["kvpp3"]),
    (L8, "pp64", ["pp64", "layers"]),
    (L70, "tp8xkvpp8", ["kvpp8", "kv_heads"]),        # GQA tp8: no replication to spread
    (DSV3, "tp8xdcp2xkvpp2", ["kvpp2", "dcp2"]),      # both would spread the same copies
])
def test_impossible_layouts_are_refused(model, layout, words):
    with pytest.raises(ConfigError) as err:
        place(model, layout)
    for w in words:
        assert w in str(err.value)


# -------------------------------------------------------------------- capacity
def test_capacity_tool_for_a_million_tokens():
    one_m = 1_000_000
    tp8 = capacity("deepseek-v3", "tp8", "h200", one_m)
    dcp = capacity("deepseek-v3", "tp8xdcp8", "h200", one_m)
    assert tp8["kv_bytes_per_token"] == dcp["kv_bytes_per_token"] == 61 * MLA_LAYER
    assert not tp8["fits"] and dcp["fits"]
    tp8_budget = 141e9 * 0.9 - tp8["weights_bytes_per_gpu"] - (2 << 30) - 65536 * 8192
    assert tp8["kv_capacity_tokens_per_gpu"] == int(tp8_budget // (61 * MLA_LAYER))
    assert dcp["persistent_kv_bytes_per_gpu"] == one_m // 8 * 61 * MLA_LAYER
    gathered_prefix = one_m * MLA_LAYER  # one layer's latents, while a prefill runs
    budget = (141e9 * 0.9 - dcp["weights_bytes_per_gpu"] - (2 << 30) - 65536 * 8192
              - gathered_prefix)
    assert dcp["kv_capacity_tokens_per_gpu"] == int(budget // (61 * MLA_LAYER / 8))
    blocks = dcp["kv_capacity_tokens_per_gpu"] // 64
    assert dcp["max_concurrent_requests"] == blocks // math.ceil(one_m / 64)
