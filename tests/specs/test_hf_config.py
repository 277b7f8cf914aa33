"""Models from Hugging Face configs: `ModelSpec.from_hf_config` and `--model PATH`.

- the readers' defaults are transformers' own (its config classes are the oracle);
- a config transformers writes for each family reads back as the numbers of that
  config object (independent of labkit's defaults);
- the published configs of the models the field benchmarks now read back as the
  hand-written presets, whose parameter totals are the published ones;
- keys labkit cannot compute are named: by the reader (shapes) or by the compute plane
  (functions), and a checkpoint whose config disagrees with its model is refused.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from labkit.errors import ConfigError
from labkit.specs import ModelSpec, get_model
from labkit.specs.hf_config import DEFAULTS, from_hf_config

from .field_configs import FIELD_CONFIGS, FIELD_TOTALS
from .reference import CONFIGS

_SHAPE = [f.name for f in dataclasses.fields(ModelSpec)
          if f.name not in ("name", "source", "constants", "block_size", "max_model_len",
                            "weight_dtype")]


def _shapes(m: ModelSpec) -> dict:
    return {k: getattr(m, k) for k in _SHAPE}


# ------------------------------------------------------------ transformers' defaults
@pytest.mark.parametrize("model_type", sorted(DEFAULTS))
def test_defaults_are_transformers_config_defaults(model_type):
    transformers = pytest.importorskip("transformers")
    # (Kimi-K2's configs name their type kimi_k2; transformers reads them as DeepSeek-V3)
    config = transformers.AutoConfig.for_model({"kimi_k2": "deepseek_v3"}.get(model_type,
                                                                              model_type))
    checked = 0
    for key, want in DEFAULTS[model_type].items():
        if key == "rope_parameters":
            have = getattr(config, key, None)
            if have is None:  # (NoPE: Kimi-Linear)
                continue
            have = have.get("main", have)  # (DeepSeek-V4 nests its main and compressed RoPE)
        elif key == "norm_topk_prob" and model_type == "kimi_linear":
            have = config.norm_topk_prob
        elif not hasattr(config, key):
            continue  # a key of the published configs transformers has no attribute for
        else:
            have = getattr(config, key)
        assert have == want, f"{model_type}.{key}: transformers {have!r}, labkit {want!r}"
        checked += 1
    assert checked >= 3


# -------------------------------------------------- configs transformers writes
FAMILY_CONFIGS = {
    "llama": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  num_hidden_layers=2, intermediate_size=128, vocab_size=512),
    "qwen3_moe": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, num_hidden_layers=3, intermediate_size=128,
                      moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                      vocab_size=512, mlp_only_layers=[0], norm_topk_prob=True),
    "deepseek_v32": dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=3,
                         vocab_size=512, q_lora_rank=32, kv_lora_rank=32,
                         qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                         n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                         topk_group=1, first_k_dense_replace=2, index_n_heads=2,
                         index_head_dim=16, index_topk=8),
    "kimi_linear": dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=4,
                        vocab_size=512, kv_lora_rank=32, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, num_experts=8,
                        layer_types=["linear_attention", "full_attention"] * 2,
                        linear_num_heads=4, linear_head_dim=16, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2),
    "gpt_oss": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, num_hidden_layers=4, intermediate_size=32, vocab_size=512,
                    num_local_experts=8, num_experts_per_tok=2, sliding_window=24),
}


@pytest.mark.parametrize("model_type", sorted(FAMILY_CONFIGS))
def test_a_config_transformers_saved_reads_back_as_its_numbers(model_type, tmp_path):
    transformers = pytest.importorskip("transformers")
    c = transformers.AutoConfig.for_model(model_type, **FAMILY_CONFIGS[model_type])
    c.save_pretrained(tmp_path)
    m = get_model(str(tmp_path))  # a folder: --model PATH
    assert m.source == str((tmp_path / "config.json").resolve())
    assert (m.num_layers, m.hidden_size, m.vocab_size, m.num_heads) == (
        c.num_hidden_layers, c.hidden_size, c.vocab_size, c.num_attention_heads)
    cfg = m.constants
    assert cfg.rms_norm_eps == c.rms_norm_eps and not cfg.unsupported
    if model_type in ("llama", "qwen3_moe", "gpt_oss"):
        assert (m.num_kv_heads, m.head_dim) == (c.num_key_value_heads, c.head_dim)
        assert cfg.rope.theta == c.rope_parameters["rope_theta"]
    if model_type == "qwen3_moe":
        assert m.first_k_dense == 1 and cfg.norm_topk_prob is True and cfg.qk_norm
    if model_type == "deepseek_v32":
        assert (m.kv_lora_rank, m.q_lora_rank, m.index_topk, m.first_k_dense) == (32, 32, 8, 2)
        assert (cfg.n_group, cfg.topk_group, cfg.rope_interleave) == (2, 1, True)
        assert cfg.routed_scaling_factor == c.routed_scaling_factor
    if model_type == "kimi_linear":
        assert m.linear_layers == (0, 2) and cfg.rope is None
        assert (m.linear_num_heads, m.linear_head_dim) == (4, 16)
        assert m.num_experts_per_tok == c.num_experts_per_tok
    if model_type == "gpt_oss":
        assert m.sliding_window_layers == tuple(
            i for i, t in enumerate(c.layer_types) if t == "sliding_attention")
        assert (cfg.rope.kind, cfg.rope.factor) == ("yarn", c.rope_parameters["factor"])
        assert cfg.attention_sinks and cfg.moe_bias and cfg.swiglu_limit == c.swiglu_limit


# --------------------------------------------------------- published configs
@pytest.mark.parametrize("name", list(FIELD_CONFIGS))
def test_field_presets_are_their_published_configs(name):
    read = from_hf_config(FIELD_CONFIGS[name], name=name)
    assert _shapes(read) == _shapes(get_model(name))
    assert read.max_model_len == get_model(name).max_model_len


@pytest.mark.parametrize("name", list(FIELD_CONFIGS))
def test_field_presets_have_the_published_parameter_totals(name):
    m = get_model(name)
    total, active = FIELD_TOTALS[name]
    assert m.total_params() / 1e9 == pytest.approx(total, rel=0.02)
    if name == "deepseek-v4":
        # documented overcount: V4's grouped low-rank output projection priced as MLA's
        assert active < m.active_params_per_token() / 1e9 < 1.5 * active
    elif name == "minimax-m2.5":  # MiniMax's "10B activated" leaves the embeddings out
        active_body = m.active_params_per_token() - m.embedding_params()
        assert active_body / 1e9 == pytest.approx(active, rel=0.05)
    else:
        assert m.active_params_per_token() / 1e9 == pytest.approx(active, rel=0.1)


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-30b-a3b", "deepseek-v3",
                                  "deepseek-v3.2", "kimi-k2", "kimi-linear-48b-a3b"])
def test_older_presets_are_their_published_configs(name):
    assert _shapes(from_hf_config(dict(CONFIGS[name]))) == _shapes(get_model(name))


def test_kimi_k25_reads_its_text_config_and_rope():
    m = from_hf_config(FIELD_CONFIGS["kimi-k2.5"])
    assert m.family == "kimi_k2" and m.constants == get_model("kimi-k2.5").constants
    assert (m.constants.rope.kind, m.constants.rope.factor, m.constants.rms_norm_eps) == (
        "yarn", 64.0, 1e-5)


def test_deepseek_v4_kv_is_compressed_as_published():
    """V4-Pro keeps one entry per 4 (CSA) or 128 (HCA) tokens: its KV per token is about
    a tenth of V3.2's (the report: 10 % of V3.2's KV cache)."""
    v4, v32 = get_model("deepseek-v4"), get_model("deepseek-v3.2")
    kept = (30 / 4 + 31 / 128) / 61
    assert v4.kv_keep_fraction == pytest.approx(kept)
    assert 0.05 < v4.kv_bytes_per_token() / v32.kv_bytes_per_token() < 0.15


# -------------------------------------------------------------- refusals
def _llama(**extra) -> dict:
    return dict(model_type="llama", num_hidden_layers=2, hidden_size=64, vocab_size=512,
                num_attention_heads=4, intermediate_size=128, **extra)


@pytest.mark.parametrize("extra,key", [
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_scaling=dict(type="dynamic", factor=2.0)), "rope_type"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(mlp_bias=True), "mlp_bias"),
])
def test_function_keys_labkit_does_not_compute_are_named_by_the_compute_plane(extra, key):
    from labkit.engine.compute.models import check_computable
    m = from_hf_config(_llama(**extra))  # the simulation still gets its shapes
    assert m.num_layers == 2
    with pytest.raises(ConfigError, match=key):
        check_computable(m)


@pytest.mark.parametrize("config,key", [
    (dict(_llama(), model_type="bloom"), "model_type 'bloom'"),
    (dict(model_type="qwen3_moe", num_hidden_layers=3, hidden_size=64, vocab_size=512,
          num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, num_experts=4,
          num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[1]),
     "mlp_only_layers"),
    (dict(_llama(), sliding_window=4096), "sliding_window"),
])
def test_shapes_labkit_cannot_represent_are_errors_naming_the_key(config, key):
    with pytest.raises(ConfigError, match=key):
        from_hf_config(config)


def test_families_without_a_torch_model_are_refused_by_the_compute_plane():
    from labkit.engine.compute.models import check_computable
    for name in ("deepseek-v4", "qwen3.5-397b-a17b", "minimax-m2.5", "glm-5"):
        with pytest.raises(ConfigError, match="compute plane"):
            check_computable(get_model(name))


def test_a_bad_path_or_json_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="unknown model preset"):
        get_model(str(tmp_path / "nowhere"))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        get_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="config.json has no 'num_"):
        get_model(str(tmp_path))
