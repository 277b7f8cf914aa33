"""Presets of the measured end-to-end runs: the published config.json numbers, the
published parameter totals, and the A100 / L40S datasheets."""

from __future__ import annotations

import pytest

from labkit.costmodel import CostModel
from labkit.specs import get_hardware, get_model

# config.json of each model (Hugging Face), the fields the preset carries
CONFIGS = {
    "llama-2-7b": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                       num_key_value_heads=32, intermediate_size=11008, vocab_size=32000,
                       max_position_embeddings=4096),
    "llama-2-70b": dict(num_hidden_layers=80, hidden_size=8192, num_attention_heads=64,
                        num_key_value_heads=8, intermediate_size=28672, vocab_size=32000,
                        max_position_embeddings=4096),
    "codellama-34b": dict(num_hidden_layers=48, hidden_size=8192, num_attention_heads=64,
                          num_key_value_heads=8, intermediate_size=22016, vocab_size=32000,
                          max_position_embeddings=16384),
    "mixtral-8x7b": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                         num_key_value_heads=8, intermediate_size=14336, vocab_size=32000,
                         max_position_embeddings=32768, num_local_experts=8,
                         num_experts_per_tok=2),
    "mixtral-8x22b": dict(num_hidden_layers=56, hidden_size=6144, num_attention_heads=48,
                          num_key_value_heads=8, intermediate_size=16384, vocab_size=32768,
                          max_position_embeddings=65536, num_local_experts=8,
                          num_experts_per_tok=2),
    "qwen3-14b": dict(num_hidden_layers=40, hidden_size=5120, num_attention_heads=40,
                      num_key_value_heads=8, head_dim=128, intermediate_size=17408,
                      vocab_size=151936, max_position_embeddings=40960),
    "qwen2.5-7b": dict(num_hidden_layers=28, hidden_size=3584, num_attention_heads=28,
                       num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
                       max_position_embeddings=131072),
    "mistral-nemo-12b": dict(num_hidden_layers=40, hidden_size=5120, num_attention_heads=32,
                             num_key_value_heads=8, head_dim=128, intermediate_size=14336,
                             vocab_size=131072, max_position_embeddings=131072),
}

# Published totals (model cards / papers), billions: total, active per token
PUBLISHED = {"llama-2-7b": (6.74, 6.74), "llama-2-70b": (68.98, 68.98),
             "codellama-34b": (33.7, 33.7), "mixtral-8x7b": (46.7, 12.9),
             "mixtral-8x22b": (141.0, 39.0), "qwen3-14b": (14.8, 14.8),
             "qwen2.5-7b": (7.61, 7.61), "mistral-nemo-12b": (12.2, 12.2)}


@pytest.mark.parametrize("name", CONFIGS)
def test_preset_matches_config_json(name):
    m, cfg = get_model(name), CONFIGS[name]
    assert m.num_layers == cfg["num_hidden_layers"]
    assert m.hidden_size == cfg["hidden_size"]
    assert m.num_heads == cfg["num_attention_heads"]
    assert m.num_kv_heads == cfg["num_key_value_heads"]
    assert m.head_dim == cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    assert m.vocab_size == cfg["vocab_size"]
    assert m.max_model_len == cfg["max_position_embeddings"]
    assert m.num_experts == cfg.get("num_local_experts", 0)
    assert m.num_experts_per_tok == cfg.get("num_experts_per_tok", 0)
    width = m.moe_intermediate_size if m.is_moe else m.intermediate_size
    assert width == cfg["intermediate_size"]


@pytest.mark.parametrize("name", PUBLISHED)
def test_parameter_counts_match_the_published_totals(name):
    m = get_model(name)
    total, active = PUBLISHED[name]
    assert m.total_params() / 1e9 == pytest.approx(total, rel=0.01)
    assert m.active_params_per_token() / 1e9 == pytest.approx(active, rel=0.01)


def test_llama2_7b_keeps_full_multi_head_kv():
    """32 KV heads: 4x the KV of Llama-3.1-8B's 8 (same hidden size and layer count)."""
    assert get_model("llama-2-7b").kv_bytes_per_token() == \
        4 * get_model("llama-3.1-8b").kv_bytes_per_token()


# NVIDIA datasheets: A100 80GB SXM and L40S (dense tensor-core peaks; bidirectional links)
T, G = 1e12, 1e9


@pytest.mark.parametrize("name, bf16, hbm, hbm_bw, link_bidir, sms", [
    ("a100-80gb", 312 * T, 80 * G, 2.039 * T, 600 * G, 108),
    ("l40s", 362.05 * T, 48 * G, 864 * G, 64 * G, 142),  # no NVLink: PCIe Gen4 x16
])
def test_measured_gpus_match_their_datasheets(name, bf16, hbm, hbm_bw, link_bidir, sms):
    hw = get_hardware(name)
    assert hw.flops("bf16") == pytest.approx(bf16)
    assert (hw.hbm_bytes, hw.hbm_bandwidth) == pytest.approx((hbm, hbm_bw))
    assert hw.nvlink_bandwidth == pytest.approx(link_bidir / 2)
    assert CostModel(name).device.sms == sms


def test_fp8_where_the_tensor_cores_have_it():
    assert get_hardware("l40s").flops("fp8") == pytest.approx(733 * T)  # 2x bf16
    a100 = get_hardware("a100-80gb")
    assert a100.flops("fp8") == a100.flops("bf16")  # no FP8 units: W8A16 at the bf16 rate
    assert get_hardware("a100") is a100
