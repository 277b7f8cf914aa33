"""One reader per Hugging Face `model_type`: a config -> ModelSpec fields.

Each reader takes an `HFConfig` (keys with transformers' defaults behind them) and
returns the keyword arguments of `ModelSpec`, `constants` (the `FamilyConfig`)
included. The compute plane runs the families of `labkit.specs.family.FAMILIES`;
the others are read for the simulation, their mechanisms mapped onto the closest
ones labkit models, as each reader's docstring says.
"""

from __future__ import annotations

from labkit.specs.family import FamilyConfig
from labkit.specs.hf_config import HFConfig, leading_dense, rope_spec, weight_dtype


def _base(cfg: HFConfig, family: str) -> dict:
    heads = cfg("num_attention_heads")
    return dict(family=family, num_layers=cfg("num_hidden_layers"),
                hidden_size=cfg("hidden_size"), vocab_size=cfg("vocab_size"), num_heads=heads,
                tie_word_embeddings=bool(cfg("tie_word_embeddings")),
                max_model_len=int(cfg("max_position_embeddings", "model_max_length")),
                weight_dtype=weight_dtype(cfg))


def _gqa(cfg: HFConfig) -> dict:
    heads = cfg("num_attention_heads")
    kv = cfg.get("num_key_value_heads") or heads
    return dict(num_kv_heads=kv, head_dim=cfg.get("head_dim") or cfg("hidden_size") // heads)


def _mla(cfg: HFConfig) -> dict:
    return dict(attention="mla", q_lora_rank=cfg("q_lora_rank") or 0,
                kv_lora_rank=cfg("kv_lora_rank"), qk_nope_head_dim=cfg("qk_nope_head_dim"),
                qk_rope_head_dim=cfg("qk_rope_head_dim"), v_head_dim=cfg("v_head_dim"),
                block_size=64)


# ---------------------------------------------------------------------- llama
def read_llama(cfg: HFConfig) -> dict:
    """Llama (and Mistral without a sliding window): GQA, dense SwiGLU."""
    if cfg.get("sliding_window"):
        raise cfg.error("sliding_window", "a Mistral-style window on every layer is not "
                        "modelled (labkit's windows need full-attention layers beside them)")
    if cfg("mlp_bias"):
        cfg.refuse("mlp_bias", "labkit's dense MLPs carry no biases")
    f = _base(cfg, "llama") | _gqa(cfg)
    f["intermediate_size"] = cfg("intermediate_size")
    f["constants"] = FamilyConfig(rope_spec(cfg, f["max_model_len"]), cfg("rms_norm_eps"),
                                  attention_bias=bool(cfg("attention_bias")),
                                  unsupported=tuple(cfg.unsupported))
    return f


# ------------------------------------------------------------------ qwen3_moe
def read_qwen3_moe(cfg: HFConfig) -> dict:
    """Qwen3-MoE: GQA with per-head q/k RMSNorm, softmax top-k router."""
    if cfg("use_sliding_window"):
        raise cfg.error("use_sliding_window", "Qwen's per-layer windows are not modelled")
    n = cfg("num_hidden_layers")
    step, only = cfg("decoder_sparse_step"), sorted(cfg("mlp_only_layers"))
    types = ["dense" if i in only or (i + 1) % step else "moe" for i in range(n)]
    f = _base(cfg, "qwen3_moe") | _gqa(cfg)
    f.update(intermediate_size=cfg("intermediate_size"),
             num_experts=cfg("num_experts", "num_local_experts"),
             num_experts_per_tok=cfg("num_experts_per_tok"),
             moe_intermediate_size=cfg("moe_intermediate_size"),
             first_k_dense=leading_dense(cfg, types, "dense", "mlp_only_layers"))
    f["constants"] = FamilyConfig(rope_spec(cfg, f["max_model_len"]), cfg("rms_norm_eps"),
                                  qk_norm=True, attention_bias=bool(cfg("attention_bias")),
                                  norm_topk_prob=bool(cfg("norm_topk_prob")),
                                  unsupported=tuple(cfg.unsupported))
    return f


# ------------------------------------------------------------------- deepseek
def read_deepseek(cfg: HFConfig) -> dict:
    """DeepSeek-V3 / R1, Kimi-K2 (and K2.5's text model), DeepSeek-V3.2 and GLM-5 (DSA):
    MLA, sigmoid router with correction bias and group-limited choice, shared experts,
    leading dense layers, MTP modules. transformers' router is sigmoid whatever
    `scoring_func` says; labkit refuses another value rather than guess."""
    mt = cfg.model_type
    family = {"kimi_k2": "kimi_k2", "deepseek_v32": "deepseek_v32",
              "glm_moe_dsa": "glm_moe_dsa"}.get(mt, "deepseek_v3")
    if cfg("moe_layer_freq") != 1:
        raise cfg.error("moe_layer_freq", "MoE layers must follow the dense ones every layer")
    if cfg("scoring_func") != "sigmoid":
        cfg.refuse("scoring_func", "labkit's DeepSeek router is sigmoid, as transformers'")
    if cfg("attention_bias"):
        cfg.refuse("attention_bias", "labkit's MLA projections carry no biases")
    n = cfg("num_hidden_layers")
    dense = cfg("first_k_dense_replace")
    if "mlp_layer_types" in cfg.raw:
        dense = leading_dense(cfg, cfg.raw["mlp_layer_types"], "dense")
    f = _base(cfg, family) | _mla(cfg)
    f.update(intermediate_size=cfg("intermediate_size"),
             num_experts=cfg("n_routed_experts", "num_local_experts"),
             num_experts_per_tok=cfg("num_experts_per_tok"),
             moe_intermediate_size=cfg("moe_intermediate_size"),
             num_shared_experts=cfg("n_shared_experts") or 0, first_k_dense=min(dense, n),
             num_mtp_modules=cfg("num_nextn_predict_layers", "num_mtp_layers") or 0)
    if mt in ("deepseek_v32", "glm_moe_dsa"):
        f.update(index_num_heads=cfg("index_n_heads"), index_head_dim=cfg("index_head_dim"),
                 index_topk=cfg("index_topk"))
        if any(t != "full" for t in cfg.raw.get("indexer_types") or ()):
            cfg.refuse("indexer_types", "layers that reuse another layer's indexer "
                       "selection are not computed (the simulation prices an indexer "
                       "on every layer)")
    f["constants"] = FamilyConfig(
        rope_spec(cfg, f["max_model_len"]), cfg("rms_norm_eps"),
        rope_interleave=bool(cfg("rope_interleave")), router_scoring="sigmoid",
        norm_topk_prob=bool(cfg("norm_topk_prob")),
        routed_scaling_factor=float(cfg("routed_scaling_factor")), router_bias=True,
        n_group=cfg("n_group") or 1, topk_group=cfg("topk_group") or 1,
        unsupported=tuple(cfg.unsupported))
    return f


# ---------------------------------------------------------------- kimi_linear
def _kimi_linear_layers(cfg: HFConfig) -> tuple[list[int], int, int, int]:
    """(0-based KDA layers, heads, head dim, conv kernel) from `linear_attn_config`
    (the published checkpoint: 1-based `kda_layers`) or transformers' flat keys."""
    lin = cfg.raw.get("linear_attn_config")
    n = cfg("num_hidden_layers")
    if lin:
        layers = [i - 1 for i in lin.get("kda_layers", [])]
        return layers, lin["num_heads"], lin["head_dim"], lin.get("short_conv_kernel_size", 4)
    types = cfg.raw.get("layer_types") or [
        "full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    return ([i for i, t in enumerate(types) if t == "linear_attention"],
            cfg("linear_num_heads"), cfg("linear_head_dim"), cfg("linear_conv_kernel_dim"))


def read_kimi_linear(cfg: HFConfig) -> dict:
    """Kimi-Linear: KDA linear-attention layers beside NoPE MLA layers (transformers'
    KimiLinearAttention rotates nothing, whatever `mla_use_nope` says)."""
    n = cfg("num_hidden_layers")
    linear, heads, dim, kernel = _kimi_linear_layers(cfg)
    dense = cfg.get("first_k_dense_replace", 1)
    if "mlp_layer_types" in cfg.raw:
        dense = leading_dense(cfg, cfg.raw["mlp_layer_types"], "dense")
    f = _base(cfg, "kimi_linear") | _mla(cfg)
    f.update(intermediate_size=cfg("intermediate_size"),
             num_experts=cfg("num_experts", "num_local_experts"),
             num_experts_per_tok=cfg("num_experts_per_token", "num_experts_per_tok"),
             moe_intermediate_size=cfg("moe_intermediate_size"),
             num_shared_experts=cfg("num_shared_experts", "n_shared_experts") or 0,
             first_k_dense=min(dense, n), linear_layers=tuple(linear),
             linear_num_heads=heads, linear_head_dim=dim, linear_conv_kernel=kernel)
    f["constants"] = FamilyConfig(
        None, cfg("rms_norm_eps"), router_scoring="sigmoid",
        norm_topk_prob=bool(cfg("moe_renormalize", "norm_topk_prob")),
        routed_scaling_factor=float(cfg("routed_scaling_factor")), router_bias=True,
        n_group=cfg("num_expert_group", "n_group") or 1, topk_group=cfg("topk_group") or 1,
        unsupported=tuple(cfg.unsupported))
    return f


# -------------------------------------------------------------------- gpt_oss
def read_gpt_oss(cfg: HFConfig) -> dict:
    """gpt-oss: GQA with biases and sinks, sliding-window layers beside full ones, a
    top-k-then-softmax router with a bias, clamped SwiGLU experts with biases."""
    n = cfg("num_hidden_layers")
    types = cfg.raw.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    f = _base(cfg, "gpt_oss") | _gqa(cfg)
    inter = cfg("intermediate_size")
    f.update(intermediate_size=inter, num_experts=cfg("num_local_experts", "num_experts"),
             num_experts_per_tok=cfg("num_experts_per_tok"), moe_intermediate_size=inter,
             sliding_window=cfg("sliding_window"),
             sliding_window_layers=tuple(i for i, t in enumerate(types)
                                         if t == "sliding_attention"))
    if not cfg("attention_bias"):
        cfg.refuse("attention_bias", "labkit's gpt-oss attention carries biases")
    f["constants"] = FamilyConfig(
        rope_spec(cfg, f["max_model_len"]), cfg("rms_norm_eps"), attention_bias=True,
        attention_sinks=True, router_scoring="topk_softmax", moe_bias=True,
        swiglu_limit=float(cfg("swiglu_limit")), swiglu_alpha=float(cfg("swiglu_alpha")),
        unsupported=tuple(cfg.unsupported))
    return f


# ------------------------------------------------------- simulation-only families
def read_minimax_m2(cfg: HFConfig) -> dict:
    """MiniMax-M2 / M2.5: GQA, 256 sigmoid-routed experts, no dense layers, MTP.
    Compute plane: refused (its q/k RMSNorm spans all heads; partial RoPE)."""
    f = _base(cfg, "minimax_m2") | _gqa(cfg)
    inter = cfg("intermediate_size")  # MiniMax's intermediate_size is an expert's
    f.update(intermediate_size=inter, num_experts=cfg("num_local_experts", "num_experts"),
             num_experts_per_tok=cfg("num_experts_per_tok"), moe_intermediate_size=inter,
             num_mtp_modules=cfg.raw.get("num_mtp_modules", 0) if cfg.raw.get("use_mtp") else 0)
    f["constants"] = FamilyConfig(rope_spec(cfg, f["max_model_len"]), cfg("rms_norm_eps"),
                                  unsupported=tuple(cfg.unsupported))
    return f


def read_qwen3_5_moe(cfg: HFConfig) -> dict:
    """Qwen3.5-MoE: gated-DeltaNet linear-attention layers beside gated full-attention
    ones (every `full_attention_interval`-th), 1 shared + routed experts, MTP.

    Mapped onto labkit's linear-attention (KDA) fields: `linear_num_heads` = the value
    heads and `linear_head_dim` = the (equal) key/value head dim, so the recurrent
    state (heads x dk x dv) is exact; the short-conv state counts q, k and v at the
    value heads' width (the real conv covers q and k at the fewer key heads: ~2x on a
    small term), and a linear layer's parameters are KDA's (~15 % over a gated
    DeltaNet's). The full-attention layers' output gate (a second q_proj half) is not
    counted. Compute plane: refused (no gated-DeltaNet model)."""
    n = cfg("num_hidden_layers")
    every = cfg.raw.get("full_attention_interval", 4)
    types = cfg.raw.get("layer_types") or [
        "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    if cfg("linear_key_head_dim") != cfg("linear_value_head_dim"):
        raise cfg.error("linear_key_head_dim", "labkit's linear-state model needs equal key "
                        "and value head dims")
    shared = cfg.raw.get("shared_expert_intermediate_size", 0)
    inter = cfg("moe_intermediate_size")
    f = _base(cfg, "qwen3_5_moe") | _gqa(cfg)
    f.update(intermediate_size=inter, num_experts=cfg("num_experts"),
             num_experts_per_tok=cfg("num_experts_per_tok"), moe_intermediate_size=inter,
             num_shared_experts=shared // inter if shared else 0,
             linear_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
             linear_num_heads=cfg("linear_num_value_heads"),
             linear_head_dim=cfg("linear_value_head_dim"),
             linear_conv_kernel=cfg("linear_conv_kernel_dim"),
             num_mtp_modules=cfg.raw.get("mtp_num_hidden_layers", 0))
    f["constants"] = FamilyConfig(rope_spec(cfg, f["max_model_len"]), cfg("rms_norm_eps"),
                                  unsupported=tuple(cfg.unsupported))
    return f


def read_deepseek_v4(cfg: HFConfig) -> dict:
    """DeepSeek-V4: compressed sparse attention, mapped for the simulation.

    Every layer attends a shared 512-dim entry per kept token (one KV head; its last
    `qk_rope_head_dim` dims roped): labkit's MLA with `kv_lora_rank` = 512 - rope, so
    a kept token costs exactly V4's bytes. A layer of compression ratio m (`compress_
    ratios` / `layer_types`: 4 for CSA, 128 for HCA, 0 for a pure window) keeps one
    entry per m tokens (`kv_compress_ratios`); CSA's lightning indexer (its heads,
    head dim and top-k) is labkit's DSA indexer, its keys counted on every layer at
    that layer's ratio. Not modelled: the 128-token uncompressed window each layer
    also keeps (bounded: ~8 MB a request), the compressor's and the grouped low-rank
    output projection's weights (priced as MLA's up/out projections: active
    parameters ~70 B against the published 49 B), hash routing of the first layers
    (priced as learned routing), mHC's four residual streams. Compute plane: refused.
    """
    n = cfg("num_hidden_layers")
    ratios = cfg.raw.get("compress_ratios")
    if ratios is None:
        rates = cfg.raw.get("compress_rates") or {"compressed_sparse_attention": 4,
                                                  "heavily_compressed_attention": 128}
        types = cfg.raw.get("layer_types") or (
            ["heavily_compressed_attention"] * min(n, 2)
            + ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
               for i in range(max(n - 2, 0))])
        ratios = [rates.get(t, 0) for t in types]
    head_dim = cfg("head_dim")
    rope = cfg.raw.get("qk_rope_head_dim") or int(
        head_dim * (cfg.raw.get("partial_rotary_factor") or 64 / 512))
    inter = cfg("moe_intermediate_size")
    f = _base(cfg, "deepseek_v4")
    f.update(attention="mla", q_lora_rank=cfg("q_lora_rank"), kv_lora_rank=head_dim - rope,
             qk_nope_head_dim=head_dim - rope, qk_rope_head_dim=rope, v_head_dim=head_dim,
             intermediate_size=inter,
             num_experts=cfg("n_routed_experts", "num_local_experts"),
             num_experts_per_tok=cfg("num_experts_per_tok"), moe_intermediate_size=inter,
             num_shared_experts=cfg("n_shared_experts") or 0,
             index_num_heads=cfg("index_n_heads"), index_head_dim=cfg("index_head_dim"),
             index_topk=cfg("index_topk"), kv_compress_ratios=tuple(ratios[:n]),
             num_mtp_modules=cfg("num_nextn_predict_layers") or 0, block_size=64)
    cfg.unsupported.append("model_type = 'deepseek_v4' (compressed sparse attention, mHC "
                           "and hash routing have no torch model in labkit)")
    f["constants"] = FamilyConfig(rope_spec(cfg, f["max_model_len"]), cfg("rms_norm_eps"),
                                  unsupported=tuple(cfg.unsupported))
    return f


READERS = {
    "llama": read_llama, "mistral": read_llama, "qwen3_moe": read_qwen3_moe,
    "deepseek_v3": read_deepseek, "kimi_k2": read_deepseek, "deepseek_v32": read_deepseek,
    "glm_moe_dsa": read_deepseek, "kimi_linear": read_kimi_linear, "gpt_oss": read_gpt_oss,
    "minimax_m2": read_minimax_m2, "qwen3_5_moe": read_qwen3_5_moe,
    "qwen3_5_moe_text": read_qwen3_5_moe, "deepseek_v4": read_deepseek_v4,
}
