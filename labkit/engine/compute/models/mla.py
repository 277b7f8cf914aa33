"""Multi-head latent attention (DeepSeek-V3/V3.2, Kimi-K2, Kimi-Linear's full layers).

Notation, per layer: n heads (a TP rank: its slice), r = kv_lora_rank, dn = qk_nope,
dr = qk_rope, dv = v_head_dim. `kv_b_proj.weight` viewed `[n, dn + dv, r]` splits into
W_UK `[n, dn, r]` and W_UV `[n, dv, r]`.

- q path: `qr = rms_norm(q_a x)`, `q = q_b qr` (or `q = q_proj x` without q_lora);
  q `[T, n, dn + dr]` = (q_nope, q_pe), RoPE on q_pe.
- latent: `kv_a_proj_with_mqa x` = (c, k_pe); `c = rms_norm(c)` `[T, r]`, k_pe `[T, dr]`
  roped and shared by all heads. The cache stores `[c; k_pe]` `[T, r + dr]` per token.
  The two inner norms (`q_a_layernorm`, `kv_a_layernorm`) use eps 1e-6 whatever the
  model's `rms_norm_eps` (Hugging Face builds them with the norm's default; Kimi's
  decoder norms use 1e-5). DeepSeek's RoPE is interleaved (`rope_interleave`: dims
  (2i, 2i+1) rotate together; `layers.rope` returns them de-interleaved, the layout
  the cache then stores); Kimi-Linear's MLA has none (NoPE).
- naive (prefill): `k_nope_h = W_UK_h c`, `v_h = W_UV_h c`, `k_h = [k_nope_h; k_pe]`,
  `out_h = softmax(scale * q_h . k_h) v_h` with `scale = (dn + dr)^-1/2`, times
  YaRN's `mscale(factor, mscale_all_dim)^2` when the model's RoPE sets it.
- absorbed (decode): `q_nope_h . (W_UK_h c_s) = (W_UK_h^T q_nope_h) . c_s`, so with
  `q_lat_h = W_UK_h^T q_nope_h` `[r]` and `q_abs_h = [q_lat_h; q_pe_h]`, the score is
  `scale * q_abs_h . latent_s` — multi-query attention over the cached latent with one
  shared KV head (keys: all r + dr dims, values: the first r dims, i.e. c). The output
  `o_lat_h = sum_s p_hs c_s` `[r]` goes back through `out_h = W_UV_h o_lat_h`. Same scale
  as naive. Partial `(o_lat, lse)` of DCP shards merge in latent space before W_UV.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from labkit.engine.compute.models.family import family_config
from labkit.engine.compute.models.layers import (
    attention, linear, rms_norm, rope, yarn_softmax_scale)
from labkit.specs.models import ModelSpec

Tensor = torch.Tensor

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm, whatever rms_norm_eps says


def mla_scale(spec: ModelSpec) -> float:
    base = 1.0 / math.sqrt(spec.qk_nope_head_dim + spec.qk_rope_head_dim)
    return base * yarn_softmax_scale(family_config(spec).rope)


def _rope(x: Tensor, spec: ModelSpec, positions: Tensor) -> Tensor:
    cfg = family_config(spec)
    return rope(x, positions, cfg.rope, interleave=cfg.rope_interleave)


def mla_q(x: Tensor, w: Mapping[str, Tensor], spec: ModelSpec,
          positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """`(q_nope [T, n, dn], q_pe [T, n, dr] roped, qr)`; qr is the normed q_lora vector
    (or x itself without q_lora) — the DSA indexer's input."""
    if "self_attn.q_a_proj.weight" in w:
        qr = rms_norm(linear(x, w["self_attn.q_a_proj.weight"]),
                      w["self_attn.q_a_layernorm.weight"], LATENT_NORM_EPS)
        q = linear(qr, w["self_attn.q_b_proj.weight"])
    else:
        qr, q = x, linear(x, w["self_attn.q_proj.weight"])
    q = q.unflatten(-1, (-1, spec.qk_nope_head_dim + spec.qk_rope_head_dim))
    q_nope, q_pe = q.split([spec.qk_nope_head_dim, spec.qk_rope_head_dim], dim=-1)
    return q_nope, _rope(q_pe, spec, positions), qr


def mla_latent(x: Tensor, w: Mapping[str, Tensor], spec: ModelSpec,
               positions: Tensor) -> Tensor:
    """The per-token cache entry `[T, r + dr]` = [rms_norm(c_kv); rope(k_pe)]."""
    c, k_pe = linear(x, w["self_attn.kv_a_proj_with_mqa.weight"]).split(
        [spec.kv_lora_rank, spec.qk_rope_head_dim], dim=-1)
    c = rms_norm(c, w["self_attn.kv_a_layernorm.weight"], LATENT_NORM_EPS)
    k_pe = _rope(k_pe[:, None, :], spec, positions)[:, 0, :]
    return torch.cat([c, k_pe], dim=-1)


def _w_ukv(kv_b_weight: Tensor, spec: ModelSpec) -> tuple[Tensor, Tensor]:
    w = kv_b_weight.view(-1, spec.qk_nope_head_dim + spec.v_head_dim, spec.kv_lora_rank)
    return w[:, : spec.qk_nope_head_dim], w[:, spec.qk_nope_head_dim:]


def mla_attention_naive(q_nope: Tensor, q_pe: Tensor, latent: Tensor, kv_b_weight: Tensor,
                        spec: ModelSpec, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """MHA over keys/values up-projected from the latent `[S, r + dr]`:
    `(out [T, n, dv], lse [T, n])`."""
    S, n = latent.shape[0], q_nope.shape[1]
    c, k_pe = latent.split([spec.kv_lora_rank, spec.qk_rope_head_dim], dim=-1)
    kv = linear(c, kv_b_weight).view(S, n, spec.qk_nope_head_dim + spec.v_head_dim)
    k_nope, v = kv.split([spec.qk_nope_head_dim, spec.v_head_dim], dim=-1)
    k = torch.cat([k_nope, k_pe[:, None, :].expand(S, n, spec.qk_rope_head_dim)], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1)
    return attention(q, k, v, mla_scale(spec), mask)


def mla_absorb_q(q_nope: Tensor, kv_b_weight: Tensor, spec: ModelSpec) -> Tensor:
    """`q_lat [T, n, r]` = W_UK^T q_nope, per head."""
    w_uk, _ = _w_ukv(kv_b_weight, spec)
    return torch.einsum("thd,hdr->thr", q_nope, w_uk)


def mla_attention_absorbed(q_lat: Tensor, q_pe: Tensor, latent: Tensor, spec: ModelSpec,
                           mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """MQA over the cached latent: `(o_lat [T, n, r], lse [T, n])`."""
    q = torch.cat([q_lat, q_pe], dim=-1)
    kv = latent[:, None, :]
    return attention(q, kv, kv[..., : spec.kv_lora_rank], mla_scale(spec), mask)


def mla_unabsorb_out(o_lat: Tensor, kv_b_weight: Tensor, spec: ModelSpec) -> Tensor:
    """`out [T, n, dv]` = W_UV o_lat, per head."""
    _, w_uv = _w_ukv(kv_b_weight, spec)
    return torch.einsum("thr,hvr->thv", o_lat, w_uv)


def mla_output(out: Tensor, w: Mapping[str, Tensor]) -> Tensor:
    """`o_proj` of `[T, n, dv]` -> `[T, H]` (a TP partial sum)."""
    return linear(out.flatten(1), w["self_attn.o_proj.weight"])
