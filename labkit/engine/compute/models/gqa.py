"""Grouped-query attention projections (Llama, Qwen3-MoE, gpt-oss).

A TP rank passes its slice of `q_proj` (whole query heads), of `k_proj`/`v_proj` (the
KV heads its query heads read) and of `o_proj` (the matching input columns); the
head counts are read off the slices. Attention itself is `layers.attention`; a
sliding-window layer (gpt-oss) has the same projections and only masks more.

gpt-oss adds biases to all four projections (`o_proj.bias` is held by one TP rank, so
the all-reduce adds it once) and a learned sink logit per query head
(`self_attn.sinks`), applied to the attention output with its log-sum-exp
(`layers.with_sinks`) — after DCP shards are merged, so exactly once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from labkit.engine.compute.models.layers import linear, rms_norm, rope, with_sinks
from labkit.specs.family import RopeSpec
from labkit.specs.models import ModelSpec

Tensor = torch.Tensor


def _proj(x: Tensor, w: Mapping[str, Tensor], name: str) -> Tensor:
    return linear(x, w[f"self_attn.{name}.weight"], w.get(f"self_attn.{name}.bias"))


def gqa_qkv(x: Tensor, w: Mapping[str, Tensor], head_dim: int, positions: Tensor,
            rope_spec: RopeSpec | float | None, eps: float = 1e-6
            ) -> tuple[Tensor, Tensor, Tensor]:
    """q `[T, Hq, D]`, k `[T, Hkv, D]` (both roped), v `[T, Hkv, D]` from hidden x `[T, H]`.

    With `self_attn.q_norm.weight` / `k_norm.weight` present (Qwen3) each head of q and
    k is RMS-normalised before RoPE. k and v are what the KV cache stores.
    """
    q = _proj(x, w, "q_proj").unflatten(-1, (-1, head_dim))
    k = _proj(x, w, "k_proj").unflatten(-1, (-1, head_dim))
    v = _proj(x, w, "v_proj").unflatten(-1, (-1, head_dim))
    if "self_attn.q_norm.weight" in w:
        q = rms_norm(q, w["self_attn.q_norm.weight"], eps)
        k = rms_norm(k, w["self_attn.k_norm.weight"], eps)
    return rope(q, positions, rope_spec), rope(k, positions, rope_spec), v


def gqa_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def gqa_sinks(out: Tensor, lse: Tensor, w: Mapping[str, Tensor]) -> Tensor:
    """The attention output with the layer's sinks, if it has any (gpt-oss)."""
    if "self_attn.sinks" not in w:
        return out
    return with_sinks(out, lse, w["self_attn.sinks"])[0]


def gqa_output(attn_out: Tensor, w: Mapping[str, Tensor]) -> Tensor:
    """`o_proj` of the attention output `[T, Hq, D]` -> `[T, H]` (a TP partial sum)."""
    return _proj(attn_out.flatten(1), w, "o_proj")


def layer_window(spec: ModelSpec, layer: int) -> int:
    """The sliding window layer `layer` attends through; 0 for full attention."""
    return spec.sliding_window if spec.is_sliding_layer(layer) else 0
