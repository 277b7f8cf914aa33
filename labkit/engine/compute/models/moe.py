"""Mixture-of-experts: routing, experts, shared experts.

Routing, per token, from router logits `z = hidden @ router_weight.T` (float32 at least):
- softmax (Qwen3-MoE): `s = softmax(z)`; pick the top-k of `s`; weights `s[picked]`,
  renormalised to sum to 1 (`norm_topk_prob`).
- sigmoid (DeepSeek-V3/V3.2, Kimi-K2, Kimi-Linear): `s = sigmoid(z)`; pick the top-k of
  `s + e_score_correction_bias` (the bias steers the choice only); weights `s[picked]`
  renormalised to 1, then times `routed_scaling_factor` (2.5, 2.827, 2.446). Group-
  limited routing (DeepSeek-V3's n_group=8/topk_group=4) is not modelled.
Ties are broken towards the lower expert id (a stable sort), and the k picks come out
in descending score order, so every rank that routes the same hidden state gets the
same `(ids, weights)` bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from labkit.engine.compute.models.family import family_config
from labkit.engine.compute.models.layers import linear, swiglu
from labkit.specs.models import ModelSpec

Tensor = torch.Tensor


def route(hidden: Tensor, router_weight: Tensor, spec: ModelSpec,
          bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """`(topk_ids [T, k] int64, topk_weights [T, k])` for hidden `[T, H]`.

    Weights are float32 (float64 if the hidden state is); they sum to 1, or to
    `routed_scaling_factor` for sigmoid routers."""
    cfg = family_config(spec)
    k = spec.num_experts_per_tok
    wide = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    logits = linear(hidden.to(wide), router_weight.to(wide))
    if cfg.router_scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
        choice = scores
    else:
        scores = torch.sigmoid(logits)
        choice = scores if bias is None else scores + bias.to(wide)
    order = torch.sort(choice, dim=-1, descending=True, stable=True).indices
    ids = order[:, :k]
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids, weights * cfg.routed_scaling_factor


def expert_ffn(x: Tensor, gate_w: Tensor, up_w: Tensor, down_w: Tensor) -> Tensor:
    """One expert (a SwiGLU MLP) on the tokens routed to it."""
    return swiglu(x, gate_w, up_w, down_w)


def expert_weights(w: Mapping[str, Tensor], expert: int) -> tuple[Tensor, Tensor, Tensor]:
    """(gate, up, down) of routed expert `expert` (global id) from a layer's weights."""
    p = f"mlp.experts.{expert}."
    return w[p + "gate_proj.weight"], w[p + "up_proj.weight"], w[p + "down_proj.weight"]


def moe_experts(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w: Mapping[str, Tensor],
                experts: Iterable[int] | None = None) -> Tensor:
    """`sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x_t)` over the routed experts
    in `experts` (default: all those routed to); an EP rank passes the experts it holds
    and gets its partial sum. Experts are applied in increasing id order."""
    out = torch.zeros_like(x)
    wanted = torch.unique(topk_ids).tolist() if experts is None else sorted(experts)
    for e in wanted:
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        y = expert_ffn(x[tok], *expert_weights(w, e))
        out.index_add_(0, tok, y * topk_weights[tok, slot, None].to(x.dtype))
    return out


def shared_experts(x: Tensor, w: Mapping[str, Tensor]) -> Tensor:
    """The always-on shared experts (one merged SwiGLU), zeros if the layer has none."""
    if "mlp.shared_experts.gate_proj.weight" not in w:
        return torch.zeros_like(x)
    p = "mlp.shared_experts."
    return swiglu(x, w[p + "gate_proj.weight"], w[p + "up_proj.weight"], w[p + "down_proj.weight"])


def moe_mlp(x: Tensor, w: Mapping[str, Tensor], spec: ModelSpec) -> Tensor:
    """A whole MoE block on one device: route, routed experts, plus shared experts."""
    ids, weights = route(x, w["mlp.gate.weight"], spec, w.get("mlp.gate.e_score_correction_bias"))
    return moe_experts(x, ids, weights, w) + shared_experts(x, w)


def dense_mlp(x: Tensor, w: Mapping[str, Tensor]) -> Tensor:
    return swiglu(x, w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"], w["mlp.down_proj.weight"])
