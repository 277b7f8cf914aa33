"""Building blocks shared by every family: pure functions of tensors.

All weights come in as arguments (never globals), stored `[out, in]` like `nn.Linear`,
so a tensor-parallel rank calls the same function on its slice: head counts are read
off the tensors' shapes, never off the spec. Tensors are token-major: hidden states
`[T, H]`, per-head tensors `[T, heads, dim]`. Math runs in the inputs' dtype, except
that half-precision inputs are normalised and soft-maxed in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def _wide(x: Tensor) -> Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """`x @ weight.T` (weight `[out, in]`, no bias)."""
    return F.linear(x, weight)


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


def rope(x: Tensor, positions: Tensor, theta: float | None) -> Tensor:
    """Plain rotary embedding of the last dim of `x` `[T, ..., D]` at `positions` `[T]`.

    HF Llama ("rotate_half", NeoX) pairing: dim `i` rotates with `i + D/2` by angle
    `pos * theta^(-2i/D)`. Angles are computed in float64 whatever `x`'s dtype (exact
    for positions up to 2^53), then cos/sin are cast to `x.dtype`. `theta=None`
    returns `x` unchanged (NoPE). No frequency scaling (Llama-3, YaRN) is applied.
    """
    if theta is None:
        return x
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"rope needs an even head dim, got {d}")
    half = d // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float64, device=x.device) * 2 / d)
    ang = positions.to(device=x.device, dtype=torch.float64)[:, None] * inv_freq[None, :]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos = ang.cos().to(x.dtype).reshape(shape)
    sin = ang.sin().to(x.dtype).reshape(shape)
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


def swiglu(x: Tensor, gate_w: Tensor, up_w: Tensor, down_w: Tensor) -> Tensor:
    """SwiGLU MLP `down(silu(gate x) * up x)`; a TP rank passes its column slice of
    gate/up (`[I/tp, H]`) and row slice of down (`[H, I/tp]`) and gets a partial sum."""
    return linear(F.silu(linear(x, gate_w)) * linear(x, up_w), down_w)
