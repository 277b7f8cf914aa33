"""Building blocks shared by every family: pure functions of tensors.

All weights come in as arguments (never globals), stored `[out, in]` like `nn.Linear`,
so a tensor-parallel rank calls the same function on its slice: head counts are read
off the tensors' shapes, never off the spec. Tensors are token-major: hidden states
`[T, H]`, per-head tensors `[T, heads, dim]`. Math runs in the inputs' dtype, except
that half-precision inputs are normalised and soft-maxed in float32.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from labkit.specs.family import RopeSpec

Tensor = torch.Tensor


def _wide(x: Tensor) -> Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`x @ weight.T (+ bias)` (weight `[out, in]`)."""
    return F.linear(x, weight, bias)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """`x / sqrt(mean(x^2) + eps) * weight` over the last dim (HF LlamaRMSNorm)."""
    xw = _wide(x)
    y = xw * torch.rsqrt(xw.pow(2).mean(-1, keepdim=True) + eps)
    return (y * _wide(weight)).to(x.dtype)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-6) -> Tensor:
    """Plain LayerNorm over the last dim (the DSA indexer's key norm)."""
    xw = _wide(x)
    return F.layer_norm(xw, xw.shape[-1:], _wide(weight), _wide(bias), eps).to(x.dtype)


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """`x / sqrt(sum(x^2) + eps)` over the last dim (KDA's q/k normalisation)."""
    xw = _wide(x)
    return (xw * torch.rsqrt(xw.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


@functools.lru_cache(maxsize=64)  # every layer of every step asks: ~20 small ops
def rope_frequencies(spec: RopeSpec, dim: int) -> tuple[Tensor, float]:
    """`(inv_freq [dim/2] float64, attention factor)` of a rotary embedding over `dim`
    dims, as Hugging Face's `ROPE_INIT_FUNCTIONS` define them (computed in float64).

    default: `theta^(-2i/dim)`. linear: divided by `factor`. llama3: wavelengths beyond
    `original / low_freq_factor` divided by `factor`, below `original /
    high_freq_factor` kept, smoothly blended between. yarn: interpolated
    (`/ factor`) and extrapolated frequencies blended by a linear ramp over the dims
    whose rotations in `original` positions lie between `beta_slow` and `beta_fast`;
    the attention factor (cos/sin are multiplied by it) is `0.1 ln(factor) + 1`, or
    the ratio of `mscale` and `mscale_all_dim`'s when both are set.

    The tensor is shared between callers (cached): read it, never write it.
    """
    base = spec.theta
    inv = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if spec.kind == "default":
        return inv, 1.0
    if spec.kind == "linear":
        return inv / spec.factor, 1.0
    if spec.kind == "llama3":
        old = spec.original_max_position_embeddings
        low_wl, high_wl = old / spec.low_freq_factor, old / spec.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / spec.factor, inv)
        smooth = (old / wavelen - spec.low_freq_factor) / (
            spec.high_freq_factor - spec.low_freq_factor)
        blended = (1 - smooth) * scaled / spec.factor + smooth * scaled
        medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        return torch.where(medium, blended, scaled), 1.0
    if spec.kind != "yarn":
        raise ValueError(f"unsupported rope kind {spec.kind!r}")
    factor, old = spec.factor, spec.original_max_position_embeddings

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = spec.attention_factor
    if attn is None:
        attn = (mscale(factor, spec.mscale) / mscale(factor, spec.mscale_all_dim)
                if spec.mscale and spec.mscale_all_dim else mscale(factor))

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(spec.beta_fast or 32), correction_dim(spec.beta_slow or 1)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (as HF: no zero-width ramp)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    return inv / factor * (1 - extrapolate) + inv * extrapolate, float(attn)


def yarn_softmax_scale(spec: RopeSpec | None) -> float:
    """The factor DeepSeek's YaRN puts on MLA's softmax scale: `mscale(factor,
    mscale_all_dim)^2` (1 without `mscale_all_dim`)."""
    if spec is None or spec.kind == "default" or not spec.mscale_all_dim or spec.factor <= 1:
        return 1.0
    m = 0.1 * spec.mscale_all_dim * math.log(spec.factor) + 1.0
    return m * m


def rope(x: Tensor, positions: Tensor, spec: RopeSpec | float | None,
         interleave: bool = False) -> Tensor:
    """Rotary embedding of the last dim of `x` `[T, ..., D]` at `positions` `[T]`.

    `spec` is a `RopeSpec` (its frequencies and attention factor, `rope_frequencies`),
    a plain base theta, or None (NoPE: `x` returned unchanged). Pairing: dim `i`
    rotates with `i + D/2` (HF "rotate_half", NeoX); with `interleave` (DeepSeek's MLA)
    dims `(2i, 2i+1)` rotate together and the result comes out de-interleaved (pair
    i's two values at i and i + D/2), as HF's `apply_rotary_pos_emb_interleave` lays
    it out — queries and keys get the same layout, so their dot products are those of
    the interleaved rotation. Angles are computed in float64 whatever `x`'s dtype,
    then cos/sin (times the attention factor) are cast to `x.dtype`.
    """
    if spec is None:
        return x
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"rope needs an even head dim, got {d}")
    half = d // 2
    if not isinstance(spec, RopeSpec):
        spec = RopeSpec(float(spec))
    inv_freq, factor = rope_frequencies(spec, d)
    ang = positions.to(device=x.device, dtype=torch.float64)[:, None] * \
        inv_freq.to(x.device)[None, :]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos = (ang.cos() * factor).to(x.dtype).reshape(shape)
    sin = (ang.sin() * factor).to(x.dtype).reshape(shape)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def causal_mask(q_positions: Tensor, k_positions: Tensor, window: int = 0) -> Tensor:
    """`[T, S]` bool, True where key position <= query position (may attend); with a
    sliding `window` > 0, also key position > query position - window (the query sees
    itself and the window - 1 positions before it)."""
    k, q = k_positions[None, :], q_positions[:, None]
    mask = k <= q
    return mask & (k > q - window) if window else mask


def attention(q: Tensor, k: Tensor, v: Tensor, scale: float,
              mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Softmax attention with grouped KV heads; returns `(out, lse)`.

    q `[T, Hq, D]`, k `[S, Hkv, D]`, v `[S, Hkv, Dv]`, Hq a multiple of Hkv: query head
    `h` reads KV head `h // (Hq // Hkv)` (HF `repeat_kv`). mask `[T, S]` or `[T, Hq, S]`
    bool, True = attend. out `[T, Hq, Dv]`; lse `[T, Hq]` is the natural-log
    log-sum-exp of the scaled, masked scores. A query with nothing to attend gets out 0
    and lse -inf, so partial results over disjoint key sets (DCP shards) merge exactly:
    `out = sum_i exp(lse_i - lse) out_i` with `lse = logsumexp_i lse_i`.
    """
    T, Hq, D = q.shape
    S, Hkv, Dv = v.shape
    if k.shape[:2] != (S, Hkv) or k.shape[2] != D or Hq % Hkv:
        raise ValueError(f"attention shapes q{tuple(q.shape)} k{tuple(k.shape)} "
                         f"v{tuple(v.shape)} do not fit")
    g = Hq // Hkv
    qw, kw, vw = _wide(q), _wide(k), _wide(v)
    scores = torch.einsum("tkgd,skd->tkgs", qw.view(T, Hkv, g, D), kw).reshape(T, Hq, S)
    scores = scores * scale
    if mask is not None:
        m = mask[:, None, :] if mask.dim() == 2 else mask
        scores = scores.masked_fill(~m, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(scores - safe[..., None])  # exp(-inf) = 0 for masked entries
    out = torch.einsum("tkgs,skd->tkgd", p.view(T, Hkv, g, S), vw).reshape(T, Hq, Dv)
    return out.to(q.dtype), lse


def with_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """Attention with a learned per-head sink logit (gpt-oss) from attention without:
    the sink joins the softmax's denominator only, so `out * exp(lse - lse')` with
    `lse' = logaddexp(lse, sink)`. Exact for merged partials too (apply once, after
    the merge). out `[T, H, D]`, lse `[T, H]`, sinks `[H]`."""
    sinks = sinks.to(lse.dtype)
    total = torch.logaddexp(lse, sinks.expand_as(lse))
    return (out * torch.exp(lse - total)[..., None].to(out.dtype)), total


def swiglu(x: Tensor, gate_w: Tensor, up_w: Tensor, down_w: Tensor,
           biases: tuple | None = None, limit: float = 0.0, alpha: float = 1.702) -> Tensor:
    """SwiGLU MLP `down(silu(gate x) * up x)`; a TP rank passes its column slice of
    gate/up (`[I/tp, H]`) and row slice of down (`[H, I/tp]`) and gets a partial sum.

    `biases` (gate, up, down; gpt-oss) are added to each projection (a TP rank holds
    the down bias on one rank only, zeros elsewhere, so the partial sums add it once).
    `limit > 0` is gpt-oss's clamped form: gate clamped above at `limit`, up to
    `[-limit, limit]`, `gate * sigmoid(alpha * gate) * (up + 1)`."""
    gb, ub, db = biases or (None, None, None)
    gate, up = linear(x, gate_w, gb), linear(x, up_w, ub)
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
        act = gate * torch.sigmoid(gate * alpha) * (up + 1)
    else:
        act = F.silu(gate) * up
    return linear(act, down_w, db)
