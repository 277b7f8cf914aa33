"""Model presets: every preset DESIGN.md names exists, its numbers are the published
config.json's, tiny variants keep their family's structure, and lookup errors help."""

from __future__ import annotations

import dataclasses

import pytest

from labkit.errors import ConfigError
from labkit.specs import MODEL_PRESETS, ModelSpec, get_model

from .reference import CONFIGS, kda_layers_0based, n_experts, top_k

# DESIGN.md §4/§5 preset names (kimi-linear-style is the design's name for the
# Kimi-Linear hybrid) and the tiny variants of each family.
DESIGN_NAMES = ["llama-3.1-8b", "llama-3.1-70b", "qwen3-30b-a3b", "deepseek-v3",
                "deepseek-v3.2", "kimi-k2", "kimi-linear-style"]
TINY_OF = {
    "tiny-llama": "llama-3.1-8b",
    "tiny-qwen3-moe": "qwen3-30b-a3b",
    "tiny-deepseek-v3": "deepseek-v3",
    "tiny-deepseek-v3.2": "deepseek-v3.2",
    "tiny-kimi-linear": "kimi-linear-48b-a3b",
    "tiny-gpt-oss": "gpt-oss-120b",
}


@pytest.mark.parametrize("name", DESIGN_NAMES + list(TINY_OF))
def test_design_presets_exist(name):
    m = get_model(name)
    assert isinstance(m, ModelSpec)
    assert m.num_layers > 0 and m.hidden_size > 0 and m.vocab_size > 0


def test_aliases_resolve_to_the_same_spec():
    assert get_model("kimi-linear-style") is get_model("kimi-linear-48b-a3b")
    assert get_model("kimi-linear") is get_model("kimi-linear-48b-a3b")


def test_spec_passes_through():
    m = dataclasses.replace(get_model("tiny-llama"), name="custom")
    assert get_model(m) is m


def test_presets_are_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_model("llama-3.1-8b").num_layers = 1


@pytest.mark.parametrize("typo", ["llama-3.1-8", "deepseek_v3", "kimi", "", "tiny"])
def test_unknown_model_lists_allowed_names(typo):
    with pytest.raises(ConfigError) as err:
        get_model(typo)
    msg = str(err.value)
    assert repr(typo) in msg
    for name in MODEL_PRESETS:
        assert name in msg
    assert isinstance(err.value, ValueError)  # callers catching ValueError still work


# ------------------------------------------------------ published config.json values
@pytest.mark.parametrize("name", list(CONFIGS))
def test_preset_matches_config_json(name):
    m, cfg = get_model(name), CONFIGS[name]
    assert m.num_layers == cfg["num_hidden_layers"]
    assert m.hidden_size == cfg["hidden_size"]
    assert m.vocab_size == cfg["vocab_size"]
    assert m.num_heads == cfg["num_attention_heads"]
    assert m.tie_word_embeddings == cfg["tie_word_embeddings"]
    if "max_position_embeddings" in cfg:
        assert m.max_model_len == cfg["max_position_embeddings"]
    if "kv_lora_rank" in cfg:
        assert m.attention == "mla"
        assert m.q_lora_rank == (cfg["q_lora_rank"] or 0)
        assert (m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (
            cfg["kv_lora_rank"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
            cfg["v_head_dim"])
    else:
        assert m.attention == "gqa"
        assert m.num_kv_heads == cfg["num_key_value_heads"]
        assert m.head_dim == cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    assert m.num_experts == n_experts(cfg)
    if m.num_experts:
        assert m.num_experts_per_tok == top_k(cfg)
        assert m.moe_intermediate_size == cfg["moe_intermediate_size"]
        assert m.num_shared_experts == cfg.get("n_shared_experts",
                                               cfg.get("num_shared_experts", 0))
        assert m.first_k_dense == cfg.get("first_k_dense_replace", 0)
    if m.num_dense_mlp_layers:
        assert m.intermediate_size == cfg["intermediate_size"]
    assert m.num_mtp_modules == cfg.get("num_nextn_predict_layers", 0)
    assert (m.index_num_heads, m.index_head_dim, m.index_topk) == (
        cfg.get("index_n_heads", 0), cfg.get("index_head_dim", 0), cfg.get("index_topk", 0))
    assert set(m.linear_layers) == kda_layers_0based(cfg)
    if m.linear_layers:
        lin = cfg["linear_attn_config"]
        assert (m.linear_num_heads, m.linear_head_dim, m.linear_conv_kernel) == (
            lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"])


def test_design_table_numbers():
    # DESIGN.md §5 table, spelled out once more in the design's own terms.
    ds = get_model("deepseek-v3")
    assert (ds.num_layers, ds.first_k_dense, ds.num_experts, ds.num_experts_per_tok,
            ds.num_shared_experts, ds.num_mtp_modules) == (61, 3, 256, 8, 1, 1)
    k2 = get_model("kimi-k2")
    assert (k2.num_layers, k2.first_k_dense, k2.num_heads, k2.num_experts) == (61, 1, 64, 384)
    v32 = get_model("deepseek-v3.2")
    assert (v32.index_num_heads, v32.index_head_dim, v32.index_topk) == (64, 128, 2048)
    qwen = get_model("qwen3-30b-a3b")
    assert (qwen.num_layers, qwen.num_experts, qwen.num_experts_per_tok,
            qwen.moe_intermediate_size, qwen.num_moe_layers) == (48, 128, 8, 768, 48)
    kl = get_model("kimi-linear-style")
    # KDA : MLA = 3 : 1 (20 KDA, 7 MLA: every 4th layer plus the last).
    assert kl.num_linear_layers == 20 and kl.num_full_attention_layers == 7
    assert [i for i in range(27) if not kl.is_linear_layer(i)] == [3, 7, 11, 15, 19, 23, 26]


@pytest.mark.parametrize("name,dtype", [
    ("llama-3.1-8b", "bf16"), ("llama-3.1-70b", "bf16"), ("qwen3-30b-a3b", "bf16"),
    ("deepseek-v3", "fp8"), ("deepseek-v3.2", "fp8"),  # block-fp8 checkpoints
    ("kimi-k2", "fp8"),  # Kimi-K2-Instruct ships block-fp8
    ("kimi-linear-48b-a3b", "bf16"),
])
def test_served_weight_dtype_is_the_checkpoint_dtype(name, dtype):
    assert get_model(name).weight_dtype == dtype


# ------------------------------------------------------------------ tiny variants
def _structure(m: ModelSpec) -> dict:
    return dict(
        family=m.family, attention=m.attention, moe=m.is_moe,
        shared_experts=m.num_shared_experts > 0, dense_first_layers=m.first_k_dense > 0,
        q_lora=m.q_lora_rank > 0, indexer=m.has_indexer, linear=bool(m.linear_layers),
        mtp=m.num_mtp_modules > 0, topk_below_experts=m.num_experts_per_tok < m.num_experts
        if m.is_moe else None,
    )


@pytest.mark.parametrize("tiny,big", TINY_OF.items())
def test_tiny_keeps_family_structure(tiny, big):
    t, b = get_model(tiny), get_model(big)
    assert _structure(t) == _structure(b)
    if b.linear_layers:
        # Same KDA:MLA ratio (3:1), the last layer full attention in both.
        ratio = lambda m: m.num_linear_layers / m.num_full_attention_layers  # noqa: E731
        assert ratio(t) == pytest.approx(ratio(b), rel=0.2)
        assert not t.is_linear_layer(t.num_layers - 1)
        assert not b.is_linear_layer(b.num_layers - 1)
    if b.first_k_dense:
        # At least one MoE layer left after the dense ones.
        assert t.num_moe_layers >= 1


@pytest.mark.parametrize("tiny", TINY_OF)
def test_tiny_is_small(tiny):
    m = get_model(tiny)
    assert m.total_params(include_mtp=True) < 10_000_000
    assert m.num_layers <= 4
    if m.attention == "gqa":
        assert m.num_heads % m.num_kv_heads == 0
    assert 0 < m.block_size <= 64
