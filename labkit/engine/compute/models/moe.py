"""Mixture-of-experts: routing, experts, shared experts.

Routing, per token, from router logits `z = hidden @ router_weight.T` (+ the router's
bias, gpt-oss), in float32 at least:
- softmax (Qwen3-MoE): `s = softmax(z)`; pick the top-k of `s`; weights `s[picked]`,
  renormalised to sum to 1 when `norm_topk_prob`.
- topk_softmax (gpt-oss): pick the top-k logits; weights `softmax(z[picked])` (the
  same as renormalised softmax scores, computed as gpt-oss does).
- sigmoid (DeepSeek-V3/V3.2, Kimi-K2, Kimi-Linear): `s = sigmoid(z)`; choose with
  `c = s + e_score_correction_bias` (the bias steers the choice only); with
  `n_group > 1` (DeepSeek-V3: 8 groups, top 4) the experts form `n_group` equal groups,
  each scored by the sum of its best two `c`, and only the `topk_group` best groups
  compete; pick the top-k of `c` among them; weights `s[picked]` renormalised to 1
  (`norm_topk_prob`), then times `routed_scaling_factor` (2.5, 2.827, 2.446).
Ties are broken towards the lower id (stable sorts), and the k picks come out in
descending order, so every rank that routes the same hidden state gets the same
`(ids, weights)` bit for bit (transformers' `torch.topk` may order ties otherwise).

An expert is a SwiGLU MLP (`layers.swiglu`): gpt-oss's carry biases and use the
clamped form (`swiglu_limit`); its down bias is added before the routing weight
multiplies, as in transformers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from labkit.engine.compute.models.family import FamilyConfig, family_config
from labkit.engine.compute.models.layers import linear, swiglu
from labkit.specs.models import ModelSpec

Tensor = torch.Tensor


def _stable_topk(values: Tensor, k: int) -> Tensor:
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k]


def route(hidden: Tensor, w: Mapping[str, Tensor], spec: ModelSpec) -> tuple[Tensor, Tensor]:
    """`(topk_ids [T, k] int64, topk_weights [T, k])` for hidden `[T, H]` and a layer's
    weights `w` (its router `mlp.gate.weight`, and bias if any).

    Weights are float32 (float64 if the hidden state is); they sum to 1, or to
    `routed_scaling_factor` for sigmoid routers."""
    cfg = family_config(spec)
    k = spec.num_experts_per_tok
    wide = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    bias = w.get("mlp.gate.bias")
    logits = linear(hidden.to(wide), w["mlp.gate.weight"].to(wide),
                    None if bias is None else bias.to(wide))
    if cfg.router_scoring == "topk_softmax":
        ids = _stable_topk(logits, k)
        return ids, torch.softmax(logits.gather(1, ids), dim=-1) * cfg.routed_scaling_factor
    if cfg.router_scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
        choice = scores
    else:
        scores = torch.sigmoid(logits)
        correction = w.get("mlp.gate.e_score_correction_bias")
        choice = scores if correction is None else scores + correction.to(wide)
        if cfg.n_group > 1:
            choice = _limit_groups(choice, cfg)
    ids = _stable_topk(choice, k)
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        eps = 1e-20 if cfg.router_scoring == "sigmoid" else 0.0  # (as transformers)
        weights = weights / (weights.sum(-1, keepdim=True) + eps)
    return ids, weights * cfg.routed_scaling_factor


def _limit_groups(choice: Tensor, cfg: FamilyConfig) -> Tensor:
    """`choice` with every expert outside the token's `topk_group` best groups at -inf."""
    T, E = choice.shape
    grouped = choice.view(T, cfg.n_group, E // cfg.n_group)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, _stable_topk(group_scores, cfg.topk_group), True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view(T, E)


def ffn(x: Tensor, w: Mapping[str, Tensor], prefix: str, cfg: FamilyConfig) -> Tensor:
    """The SwiGLU MLP whose tensors are `{prefix}{gate,up,down}_proj.{weight,bias}`."""
    names = [f"{prefix}{p}_proj" for p in ("gate", "up", "down")]
    biases = tuple(w.get(n + ".bias") for n in names) if names[0] + ".bias" in w else None
    return swiglu(x, *(w[n + ".weight"] for n in names), biases, cfg.swiglu_limit,
                  cfg.swiglu_alpha)


def expert_ffn(x: Tensor, w: Mapping[str, Tensor], expert: int, cfg: FamilyConfig) -> Tensor:
    """Routed expert `expert` (global id) on the tokens routed to it."""
    return ffn(x, w, f"mlp.experts.{expert}.", cfg)


def moe_experts(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w: Mapping[str, Tensor],
                spec: ModelSpec, experts: Iterable[int] | None = None) -> Tensor:
    """`sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x_t)` over the routed experts
    in `experts` (default: all those routed to); an EP rank passes the experts it holds
    and gets its partial sum. Experts are applied in increasing id order."""
    cfg = family_config(spec)
    out = torch.zeros_like(x)
    wanted = torch.unique(topk_ids).tolist() if experts is None else sorted(experts)
    for e in wanted:
        if e < 0:
            continue
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        y = expert_ffn(x[tok], w, e, cfg)
        out.index_add_(0, tok, y * topk_weights[tok, slot, None].to(x.dtype))
    return out


def shared_experts(x: Tensor, w: Mapping[str, Tensor], spec: ModelSpec) -> Tensor:
    """The always-on shared experts (one merged SwiGLU), zeros if the layer has none."""
    if "mlp.shared_experts.gate_proj.weight" not in w:
        return torch.zeros_like(x)
    return ffn(x, w, "mlp.shared_experts.", family_config(spec))


def moe_mlp(x: Tensor, w: Mapping[str, Tensor], spec: ModelSpec) -> Tensor:
    """A whole MoE block on one device: route, routed experts, plus shared experts."""
    ids, weights = route(x, w, spec)
    return moe_experts(x, ids, weights, w, spec) + shared_experts(x, w, spec)


def dense_mlp(x: Tensor, w: Mapping[str, Tensor], spec: ModelSpec) -> Tensor:
    return ffn(x, w, "mlp.", family_config(spec))
