"""The constants that make a model compute what it computes, beyond its shapes.

`ModelSpec` carries the shapes a serving engine plans with (layers, heads, experts,
KV bytes). Two models of the same shapes still compute different functions if their
RoPE base, norm epsilon or router differ; those constants live here, in a
`FamilyConfig`. A model read from a Hugging Face `config.json` carries its own
(`hf_config.py` reads every one); a preset without one takes its family's defaults,
`FAMILIES`, which are the values of that family's published checkpoints:

| family        | rope                         | rms eps | router                              |
| ------------- | ---------------------------- | ------- | ----------------------------------- |
| llama         | 500000, llama3 x8            | 1e-5    | -                                   |
| qwen3_moe     | 1e6                          | 1e-6    | softmax, top-k renormalised         |
| deepseek_v3   | 10000, YaRN x40, interleaved | 1e-6    | sigmoid (+bias), 8 groups / top-4, x2.5 |
| deepseek_v32  | as deepseek_v3               | 1e-6    | as deepseek_v3                      |
| kimi_k2       | 50000, YaRN x32, interleaved | 1e-5    | sigmoid (+bias), 1 group, x2.827    |
| kimi_linear   | NoPE (MLA)                   | 1e-5    | sigmoid (+bias), 1 group, x2.446    |
| gpt_oss       | 150000, YaRN x32             | 1e-5    | softmax of the top-k logits (+bias) |

The compute plane reads only these (`engine/compute/models`); the simulation reads
none of them. A config key that changes the function but that labkit does not compute
is recorded in `unsupported`, and the compute plane refuses the model naming it (the
simulation, which needs only shapes, still runs it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """Rotary position embedding, as Hugging Face's `rope_parameters` describe it.

    `kind` "default" rotates pair i by `pos * theta^(-2i/d)`; "yarn" blends
    interpolated and extrapolated frequencies (`factor`, `beta_fast`, `beta_slow`,
    `original_max_position_embeddings`, `truncate`) and scales cos/sin by its
    attention factor (`attention_factor`, else derived from `mscale` /
    `mscale_all_dim`); "llama3" divides the low frequencies by `factor`
    (`low_freq_factor`, `high_freq_factor`). `mscale_all_dim` also multiplies MLA's
    softmax scale by `mscale(factor, mscale_all_dim)^2` (DeepSeek)."""

    theta: float
    kind: str = "default"  # "default" | "yarn" | "llama3"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None  # yarn; None: derived
    truncate: bool = True  # yarn: round the correction range to whole dims
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3


@dataclass(frozen=True, slots=True)
class FamilyConfig:
    rope: RopeSpec | None  # None: no rotation (NoPE) in the full-attention layers
    rms_norm_eps: float
    rope_interleave: bool = False  # MLA: rope dims rotate in pairs (2i, 2i+1) (DeepSeek)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k before RoPE
    attention_bias: bool = False  # GQA q/k/v/o projections carry biases (gpt-oss)
    attention_sinks: bool = False  # a learned per-head logit in every softmax (gpt-oss)
    router_scoring: str = "softmax"  # "softmax" | "sigmoid" | "topk_softmax" (gpt-oss)
    norm_topk_prob: bool = True  # renormalise the k selected weights to sum to 1
    routed_scaling_factor: float = 1.0
    router_bias: bool = False  # sigmoid routers carry `e_score_correction_bias`
    n_group: int = 1  # group-limited routing: experts in n_group groups ...
    topk_group: int = 1  # ... a token picks from its topk_group best groups only
    moe_bias: bool = False  # router logits and experts carry biases (gpt-oss)
    swiglu_limit: float = 0.0  # > 0: gpt-oss's clamped SwiGLU (see moe.py)
    swiglu_alpha: float = 1.702
    unsupported: tuple[str, ...] = ()  # config keys labkit cannot compute (the reason)


_DEEPSEEK_YARN = RopeSpec(10000.0, "yarn", factor=40.0, original_max_position_embeddings=4096,
                          mscale=1.0, mscale_all_dim=1.0)
_DEEPSEEK = FamilyConfig(_DEEPSEEK_YARN, 1e-6, rope_interleave=True, router_scoring="sigmoid",
                         routed_scaling_factor=2.5, router_bias=True, n_group=8, topk_group=4)

FAMILIES: dict[str, FamilyConfig] = {
    "llama": FamilyConfig(RopeSpec(500000.0, "llama3", factor=8.0,
                                   original_max_position_embeddings=8192), 1e-5),
    "qwen3_moe": FamilyConfig(RopeSpec(1e6), 1e-6, qk_norm=True),
    "deepseek_v3": _DEEPSEEK,
    "deepseek_v32": _DEEPSEEK,
    "kimi_k2": FamilyConfig(RopeSpec(50000.0, "yarn", factor=32.0,
                                     original_max_position_embeddings=4096, beta_fast=1.0,
                                     beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
                            1e-5, rope_interleave=True, router_scoring="sigmoid",
                            routed_scaling_factor=2.827, router_bias=True),
    "kimi_linear": FamilyConfig(None, 1e-5, router_scoring="sigmoid",
                                routed_scaling_factor=2.446, router_bias=True),
    "gpt_oss": FamilyConfig(RopeSpec(150000.0, "yarn", factor=32.0,
                                     original_max_position_embeddings=4096, truncate=False),
                            1e-5, attention_bias=True, attention_sinks=True,
                            router_scoring="topk_softmax", moe_bias=True, swiglu_limit=7.0),
}
