"""The MLP of a layer on one rank: dense, or mixture-of-experts across an EP group.

- Dense MLP and shared experts: TP slices (gate/up by rows, down by columns), so each
  rank returns a partial sum that the TP group all-reduces.
- Routed experts without EP: every TP rank holds a slice of every expert — also a
  partial sum, reduced with the rest.
- Routed experts with EP (and DEP): each rank of an EP group holds whole experts.
  Every rank routes its own tokens (the router is replicated, so every rank picks the
  same experts for the same token), then **dispatches** each token to the members
  holding its experts (all-to-all), each member runs its experts on what it received,
  and the partial sums travel back (**combine**, all-to-all) and are added in member
  order — deterministic. Ranks of a TP group hold the same tokens and each dispatches
  its own copy: redundant work, exact results.
"""

from __future__ import annotations

import torch

from labkit.engine.compute.models.family import family_config
from labkit.engine.compute.models.moe import (
    dense_mlp, expert_ffn, moe_experts, route, shared_experts)
from labkit.engine.compute.rank import RankStep

Tensor = torch.Tensor


def mlp(rs: RankStep, layer: int, w: dict, x: Tensor) -> Tensor:
    """Returns the layer's MLP output, already reduced over the TP group."""
    spec = rs.rank.spec
    if not spec.is_moe_layer(layer):
        return rs.rank.tp.all_reduce(dense_mlp(x, w, spec))
    ids, weights = route(x, w, spec)
    if len(rs.rank.place.ep_group) == 1:
        return rs.rank.tp.all_reduce(moe_experts(x, ids, weights, w, spec)
                                     + shared_experts(x, w, spec))
    routed = _expert_parallel(rs, x, ids, weights, w)
    return routed + rs.rank.tp.all_reduce(shared_experts(x, w, spec))


def owned_experts(num_experts: int, ep: int, ep_index: int) -> range:
    per = num_experts // ep
    return range(ep_index * per, (ep_index + 1) * per)


def _expert_parallel(rs: RankStep, x: Tensor, ids: Tensor, weights: Tensor, w: dict) -> Tensor:
    ep_group, spec = rs.rank.ep, rs.rank.spec
    per = spec.num_experts // ep_group.size
    owner = ids // per  # [T, k] the member holding each pick
    xs, id_s, w_s, picks = [], [], [], []
    for m in range(ep_group.size):
        tokens = torch.nonzero((owner == m).any(-1)).flatten()
        mine = owner[tokens] == m  # the token's picks on member m; the rest masked out
        picks.append(tokens)
        xs.append(x[tokens])
        id_s.append(torch.where(mine, ids[tokens], -1))
        w_s.append(torch.where(mine, weights[tokens], 0))
    received = zip(*(ep_group.all_to_all(parts) for parts in (xs, id_s, w_s)))
    results = [_local_experts(xt, it, wt, w, rs, per) for xt, it, wt in received]
    back = ep_group.all_to_all(results)
    out = torch.zeros_like(x)
    for tokens, part in zip(picks, back):
        out.index_add_(0, tokens, part)
    return out


def _local_experts(x: Tensor, ids: Tensor, weights: Tensor, w: dict, rs: RankStep,
                   per: int) -> Tensor:
    """Sum over each token's picks that live here, in increasing expert id."""
    out = torch.zeros_like(x)
    first = rs.rank.place.ep_index * per
    cfg = family_config(rs.rank.spec)
    for e in range(first, first + per):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel():
            y = expert_ffn(x[tok], w, e, cfg)
            out.index_add_(0, tok, y * weights[tok, slot, None].to(x.dtype))
    return out
