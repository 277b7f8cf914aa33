"""KV-cache bytes per token (DESIGN.md §2, §5), against formulas written out here."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from labkit.errors import ConfigError
from labkit.specs import MODEL_PRESETS, ModelSpec, get_model

from .reference import CONFIGS, kda_layers_0based

BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}
MLA_PRESETS = [n for n, m in MODEL_PRESETS.items() if m.attention == "mla"]
GQA_PRESETS = [n for n, m in MODEL_PRESETS.items() if m.attention == "gqa"]
# DeepSeek-V3.2 indexer key cache per token per layer: index_head_dim fp8 values plus
# one fp32 scale per 128 of them (vLLM DeepseekV32IndexerCache / SGLang
# NSATokenToKVPool: index_head_dim + index_head_dim // 128 * 4 bytes).
V32_INDEXER_BYTES = 128 + 128 // 128 * 4


# ----------------------------------------------------------------------------- MLA
def test_mla_latent_is_576_elements():
    # DESIGN.md §5: kv_lora 512 + qk_rope 64 = 576 elements (bf16: 1152 bytes).
    for name in ("deepseek-v3", "kimi-k2"):
        m = get_model(name)
        cfg = CONFIGS[name]
        assert cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] == 576
        assert m.kv_elements_per_token_per_layer() == 576
        assert m.kv_bytes_per_token_per_layer("bf16") == 1152
        assert m.kv_bytes_per_token_per_layer("fp8") == 576
        assert m.kv_bytes_per_token("bf16") == 61 * 1152
        assert m.kv_bytes_per_token("fp8") == 61 * 576


def test_mla_kv_does_not_depend_on_heads():
    # One latent shared by all heads: Kimi-K2 (64 heads) stores what DeepSeek-V3
    # (128 heads) stores.
    assert (get_model("kimi-k2").kv_bytes_per_token_per_layer()
            == get_model("deepseek-v3").kv_bytes_per_token_per_layer())
    m = get_model("deepseek-v3")
    assert replace(m, num_heads=16).kv_bytes_per_token() == m.kv_bytes_per_token()


@pytest.mark.parametrize("name", MLA_PRESETS)
def test_every_mla_preset_stores_latent_plus_rope(name):
    m = get_model(name)
    per_layer = (m.kv_lora_rank + m.qk_rope_head_dim) * 2
    if m.index_topk:
        # fp8 indexer keys plus one fp32 scale per block of (up to) 128 of them.
        per_layer += m.index_head_dim + math.ceil(m.index_head_dim / 128) * 4
    full_layers = m.num_layers - len(m.linear_layers)
    if m.kv_compress_ratios:  # DeepSeek-V4: a layer of ratio r keeps one token in r
        kept = sum(1 / max(r, 1) for r in m.kv_compress_ratios)
        assert m.kv_bytes_per_token("bf16") == pytest.approx(kept * per_layer)
        return
    assert m.kv_bytes_per_token("bf16") == full_layers * per_layer


def test_mtp_layer_adds_one_layer_of_kv():
    ds = get_model("deepseek-v3")
    assert ds.kv_bytes_per_token(include_mtp=True) == (61 + 1) * 1152
    llama = get_model("llama-3.1-8b")  # no MTP: unchanged
    assert llama.kv_bytes_per_token(include_mtp=True) == llama.kv_bytes_per_token()


# ----------------------------------------------------------------------------- GQA
@pytest.mark.parametrize("name,layers,kv_heads,head_dim,per_token_kib", [
    # A K and a V per KV head: the familiar "128 KiB per token" of Llama-3.1-8B in
    # bf16, 320 KiB for 70B, 96 KiB for Qwen3-30B-A3B (4 KV heads, 48 layers).
    ("llama-3.1-8b", 32, 8, 128, 128),
    ("llama-3.1-70b", 80, 8, 128, 320),
    ("qwen3-30b-a3b", 48, 4, 128, 96),
])
def test_gqa_kv_bytes(name, layers, kv_heads, head_dim, per_token_kib):
    m = get_model(name)
    for dtype in ("bf16", "fp8"):
        per_layer = 2 * kv_heads * head_dim * BYTES[dtype]
        assert m.kv_bytes_per_token_per_layer(dtype) == per_layer
        assert m.kv_bytes_per_token(dtype) == layers * per_layer
    assert m.kv_bytes_per_token("bf16") == per_token_kib * 1024
    assert m.kv_bytes_per_token("fp8") * 2 == m.kv_bytes_per_token("bf16")


@given(layers=st.integers(1, 128), kv_heads=st.integers(1, 64),
       head_dim=st.sampled_from([32, 64, 80, 96, 128, 256]),
       q_per_kv=st.integers(1, 8), dtype=st.sampled_from(sorted(BYTES)))
def test_gqa_formula_random_shapes(layers, kv_heads, head_dim, q_per_kv, dtype):
    m = ModelSpec("x", "llama", num_layers=layers, hidden_size=1024, vocab_size=1000,
                  num_heads=kv_heads * q_per_kv, num_kv_heads=kv_heads, head_dim=head_dim)
    assert m.kv_bytes_per_token(dtype) == layers * 2 * kv_heads * head_dim * BYTES[dtype]


@given(layers=st.integers(1, 100), kv_lora=st.sampled_from([128, 256, 512, 1024]),
       rope=st.sampled_from([0, 32, 64]), heads=st.integers(1, 128),
       dtype=st.sampled_from(sorted(BYTES)))
def test_mla_formula_random_shapes(layers, kv_lora, rope, heads, dtype):
    m = ModelSpec("x", "deepseek_v3", num_layers=layers, hidden_size=1024, vocab_size=1000,
                  num_heads=heads, attention="mla", kv_lora_rank=kv_lora,
                  qk_nope_head_dim=128, qk_rope_head_dim=rope, v_head_dim=128)
    assert m.kv_bytes_per_token(dtype) == layers * (kv_lora + rope) * BYTES[dtype]


# ------------------------------------------------------------------------ indexer
def test_deepseek_v32_adds_indexer_keys():
    v3, v32 = get_model("deepseek-v3"), get_model("deepseek-v3.2")
    assert V32_INDEXER_BYTES == 132
    for dtype in ("bf16", "fp8"):
        # The indexer keys are fp8 whatever the dtype of the latent.
        assert v32.kv_bytes_per_token_per_layer(dtype) == 576 * BYTES[dtype] + 132
        assert v32.kv_bytes_per_token(dtype) == 61 * (576 * BYTES[dtype] + 132)
        assert v32.kv_bytes_per_token(dtype) - v3.kv_bytes_per_token(dtype) == 61 * 132
    assert v32.kv_bytes_per_token("bf16", include_mtp=True) == 62 * (1152 + 132)


# ------------------------------------------------------------------------- hybrid
def test_kimi_linear_only_mla_layers_hold_kv():
    m = get_model("kimi-linear-48b-a3b")
    cfg = CONFIGS["kimi-linear-48b-a3b"]
    full = cfg["linear_attn_config"]["full_attn_layers"]  # 1-based, 7 of 27
    assert set(m.linear_layers) == kda_layers_0based(cfg)
    assert m.num_full_attention_layers == len(full) == 7
    assert m.kv_bytes_per_token("bf16") == 7 * 1152
    assert m.kv_bytes_per_token("fp8") == 7 * 576
    # Kimi-Linear README: "reduces the need for large KV caches by up to 75%" against
    # full MLA in every layer.
    all_mla = 27 * 1152
    saving = 1 - m.kv_bytes_per_token("bf16") / all_mla
    assert 0.73 < saving <= 0.75


def test_kimi_linear_fixed_state_per_sequence():
    m = get_model("kimi-linear-48b-a3b")
    lin = CONFIGS["kimi-linear-48b-a3b"]["linear_attn_config"]
    heads, dim, kernel = lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"]
    kda_layers = len(lin["kda_layers"])
    assert kda_layers == 20
    # KDA state per layer: a dim x dim recurrent matrix per head, plus the last
    # (kernel - 1) inputs of the q, k and v short convolutions (bf16).
    for state_dtype in ("fp32", "bf16"):
        recurrent = heads * dim * dim * BYTES[state_dtype]
        conv = 3 * (kernel - 1) * heads * dim * 2
        expected = kda_layers * (recurrent + conv)
        assert m.linear_state_bytes_per_sequence(state_dtype) == expected
    # 20 layers x 32 heads x 128 x 128 x 4 bytes = 40 MiB of fp32 recurrent state.
    assert m.linear_state_bytes_per_sequence("fp32") > 40 * 2**20
    # Per token the KV grows only in the MLA layers; the state does not grow:
    # 1M tokens of KV cost far more than the state.
    assert m.kv_bytes_per_token() * 2**20 > 100 * m.linear_state_bytes_per_sequence()


@pytest.mark.parametrize("name", [n for n, m in MODEL_PRESETS.items() if not m.linear_layers])
def test_models_without_linear_layers_have_no_state(name):
    m = get_model(name)
    assert m.linear_state_bytes_per_sequence() == 0
    assert m.num_full_attention_layers + m.num_sliding_layers == m.num_layers


def test_gpt_oss_kv_by_hand():
    # openai/gpt-oss-120b config.json: 36 layers alternating sliding_attention (window
    # 128) and full_attention, 8 KV heads of 64 dims.
    m = get_model("gpt-oss-120b")
    per_layer = 2 * 8 * 64 * 2  # key + value, bf16
    assert m.kv_bytes_per_token_per_layer() == per_layer
    assert m.num_full_attention_layers == m.num_sliding_layers == 18
    assert m.kv_bytes_per_token() == 18 * per_layer == m.sliding_kv_bytes_per_token()
    assert [m.is_sliding_layer(i) for i in range(4)] == [True, False, True, False]
    assert m.sliding_window == 128


@pytest.mark.parametrize("change,message", [
    (dict(sliding_window=0), "need sliding_window"),
    (dict(sliding_window_layers=(0, 1)), "at least one full-attention layer"),
    (dict(sliding_window_layers=(0, 5)), "outside"),
    (dict(linear_layers=(0,)), "both sliding-window and linear"),
])
def test_inconsistent_sliding_window_specs_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        replace(get_model("tiny-gpt-oss"), **change)


def test_tiny_kimi_linear_keeps_the_hybrid_kv_rule():
    m = get_model("tiny-kimi-linear")
    full_layers = m.num_layers - len(m.linear_layers)
    assert full_layers == 1
    assert m.kv_bytes_per_token() == full_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * 2
    h, d, k = m.linear_num_heads, m.linear_head_dim, m.linear_conv_kernel
    assert m.linear_state_bytes_per_sequence() == 3 * (h * d * d * 4 + 3 * (k - 1) * h * d * 2)


def test_unknown_kv_dtype_lists_allowed():
    with pytest.raises(ConfigError) as err:
        get_model("llama-3.1-8b").kv_bytes_per_token("int3")
    msg = str(err.value)
    assert "int3" in msg
    for dtype in BYTES:
        assert dtype in msg
