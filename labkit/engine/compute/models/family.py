"""Per-family constants that `ModelSpec` does not carry (RoPE base, norm epsilon, router).

Values are those of each family's published `config.json`:

| family        | rope_theta | rms eps | router                      | routed scaling |
| ------------- | ---------- | ------- | --------------------------- | -------------- |
| llama         | 500000     | 1e-5    | -                           | -              |
| qwen3_moe     | 1e6        | 1e-6    | softmax, top-k renormalised | 1.0            |
| deepseek_v3   | 10000      | 1e-6    | sigmoid (+bias), renorm     | 2.5            |
| deepseek_v32  | 10000      | 1e-6    | as deepseek_v3              | 2.5            |
| kimi_k2       | 50000      | 1e-5    | sigmoid (+bias), renorm     | 2.827          |
| kimi_linear   | NoPE (MLA) | 1e-5    | sigmoid (+bias), renorm     | 2.446          |
| gpt_oss       | 150000     | 1e-5    | softmax, top-k renormalised | 1.0            |

Simplifications, on purpose: plain RoPE everywhere (no Llama-3 frequency scaling, no
YaRN and so no YaRN softmax-scale correction for DeepSeek/Kimi); no group-limited routing
(DeepSeek-V3's 8 groups / top-4 groups; Kimi-K2 and Kimi-Linear use one group, so theirs
is exact). Kimi-Linear's MLA layers really use no positional encoding (`mla_use_nope`):
their rope dims exist but are not rotated.

gpt-oss is simplified further: no attention sinks (the learned per-head logit added to
every softmax), no biases (attention projections, router and experts carry none here),
plain SwiGLU experts (no clamp, no `alpha` in the gate's sigmoid, no `+ 1` on up) and
plain RoPE (no YaRN). Its structure — sliding-window layers alternating with full
attention, a softmax top-k router — is what labkit keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.errors import unknown_choice
from labkit.specs.models import ModelSpec


@dataclass(frozen=True, slots=True)
class FamilyConfig:
    rope_theta: float | None  # None: no rotation (NoPE) in the full-attention layers
    rms_norm_eps: float
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k before RoPE
    router_scoring: str = "softmax"  # "softmax" | "sigmoid"
    norm_topk_prob: bool = True  # renormalise the k selected weights to sum to 1
    routed_scaling_factor: float = 1.0
    router_bias: bool = False  # sigmoid routers carry `e_score_correction_bias`


_DEEPSEEK = FamilyConfig(10000.0, 1e-6, router_scoring="sigmoid",
                         routed_scaling_factor=2.5, router_bias=True)

FAMILIES: dict[str, FamilyConfig] = {
    "llama": FamilyConfig(500000.0, 1e-5),
    "qwen3_moe": FamilyConfig(1e6, 1e-6, qk_norm=True),
    "deepseek_v3": _DEEPSEEK,
    "deepseek_v32": _DEEPSEEK,
    "kimi_k2": FamilyConfig(50000.0, 1e-5, router_scoring="sigmoid",
                            routed_scaling_factor=2.827, router_bias=True),
    "kimi_linear": FamilyConfig(None, 1e-5, router_scoring="sigmoid",
                                routed_scaling_factor=2.446, router_bias=True),
    "gpt_oss": FamilyConfig(150000.0, 1e-5),
}


def family_config(spec: ModelSpec) -> FamilyConfig:
    """The constants of `spec.family`; a clear error for an unknown family."""
    try:
        return FAMILIES[spec.family]
    except KeyError:
        raise unknown_choice("model family", spec.family, FAMILIES) from None
