"""The DSA lightning indexer (DeepSeek-V3.2): which past tokens each query attends.

Per query token t (Hi heads of Di) and past token s, as transformers' DeepseekV32
computes it:
    q_idx[t, h]  = indexer.wq_b(qr_t)            qr: MLA's normed q_lora (or x)
    k_idx[s]     = layer_norm(indexer.wk(x_s))   one key per token, shared by heads
    w[t, h]      = indexer.weights_proj(x_t)[h] * Hi^-1/2
    score[t, s]  = sum_h w[t, h] * relu(Di^-1/2 * q_idx[t, h] . k_idx[s])
RoPE (the MLA layer's, YaRN included) rotates the first `qk_rope_head_dim` dims of
q_idx and k_idx, as V3.2 puts its rope dims first, *not* interleaved (unlike MLA's).
V3.2's Hadamard rotation (orthogonal, so it changes no score) and fp8 quantisation of
q/k are not modelled. The k_idx of every token is cached beside the MLA latent (the
indexer key cache).

Selection: per query the `index_topk` highest-scoring causal positions (all of them when
fewer), ties broken towards the lower position; attention then runs over the selected
positions only (mask `causal & selected`). transformers picks with `torch.topk`, whose
choice among *tied* scores is unspecified: where scores tie at the k-th place the two
may select different (equally valid) positions. labkit's rule is deterministic and
independent of how shards order their candidates; with real-valued scores ties are
rare (the oracle tests see none).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from labkit.engine.compute.models.family import family_config
from labkit.engine.compute.models.layers import layer_norm, linear, rope
from labkit.specs.models import ModelSpec

Tensor = torch.Tensor


def _rope_front(x: Tensor, positions: Tensor, spec: ModelSpec) -> Tensor:
    d = min(spec.qk_rope_head_dim, x.shape[-1]) // 2 * 2
    cfg = family_config(spec)
    if d == 0 or cfg.rope is None:
        return x
    return torch.cat([rope(x[..., :d], positions, cfg.rope), x[..., d:]], dim=-1)


def indexer_q(qr: Tensor, w: Mapping[str, Tensor], spec: ModelSpec,
              positions: Tensor) -> Tensor:
    """Index queries `[T, Hi, Di]` from qr (MLA's normed q_lora, or x without q_lora)."""
    q = linear(qr, w["self_attn.indexer.wq_b.weight"]).unflatten(-1, (-1, spec.index_head_dim))
    return _rope_front(q, positions, spec)


def indexer_k(x: Tensor, w: Mapping[str, Tensor], spec: ModelSpec, positions: Tensor,
              eps: float = 1e-6) -> Tensor:
    """Index keys `[T, Di]` (what the indexer key cache stores)."""
    k = layer_norm(linear(x, w["self_attn.indexer.wk.weight"]),
                   w["self_attn.indexer.k_norm.weight"], w["self_attn.indexer.k_norm.bias"], eps)
    return _rope_front(k[:, None, :], positions, spec)[:, 0, :]


def indexer_weights(x: Tensor, w: Mapping[str, Tensor], spec: ModelSpec) -> Tensor:
    """Per-query head weights `[T, Hi]`, 1/sqrt(Hi) folded in."""
    return linear(x, w["self_attn.indexer.weights_proj.weight"]) * spec.index_num_heads ** -0.5


def indexer_scores(q_idx: Tensor, k_idx: Tensor, head_weights: Tensor) -> Tensor:
    """`[T, S]` = sum_h head_weights[t, h] * relu(q_idx[t, h] . k_idx[s] / sqrt(Di))."""
    dots = torch.einsum("thd,sd->ths", q_idx, k_idx) * q_idx.shape[-1] ** -0.5
    return torch.einsum("ths,th->ts", torch.relu(dots), head_weights)


def dsa_select(scores: Tensor, mask: Tensor, topk: int,
               k_positions: Tensor | None = None) -> Tensor:
    """`[T, S]` bool: per query, the `topk` best allowed (`mask`) keys.

    Ordered by score, descending, then by position, ascending (`k_positions`, default
    the column index) — so shards that gather their candidates in any order agree."""
    T, S = scores.shape
    if k_positions is None:
        by_pos = torch.arange(S, device=scores.device)
    else:
        by_pos = torch.sort(k_positions, stable=True).indices
    s = scores.masked_fill(~mask, float("-inf"))[:, by_pos]
    order = by_pos[torch.sort(s, dim=-1, descending=True, stable=True).indices[:, : min(topk, S)]]
    selected = torch.zeros(T, S, dtype=torch.bool, device=scores.device)
    selected.scatter_(1, order, True)
    return selected & mask
