"""Kimi Delta Attention (KDA), the linear-attention layers of Kimi-Linear.

Per head, a state S `[dk, dv]`; per token, with q, k l2-normalised (q also times
dk^-1/2), a per-channel log-decay g `[dk]` (<= 0) and a write strength beta in (0, 1):

    S <- diag(exp(g)) S                      decay, channel by channel
    S <- S + beta k (v - k^T S)^T            delta-rule write (after the decay)
    o  = S^T q

as in fla's `naive_recurrent_kda`. The layer around it (Kimi-Linear, HF
`KimiDeltaAttention`): q, k, v = silu(causal depthwise conv_K(proj(x))) ("short conv",
skipped when K == 0); `g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)`;
`beta = sigmoid(b_proj(x))`; output `o_proj(rms_norm(o) * o_norm.weight *
sigmoid(g_b(g_a(x))))` per head. The state a sequence carries is `KDAState`: the last
K-1 pre-conv inputs of q, k, v and S — fixed size, overwritten every token.

`kda_chunked` computes the same recurrence chunk by chunk (the WY / UT form): within a
chunk with cumulative decay G_t = sum_{s<=t} g_s, the written values u_t =
beta_t (v_t - k_t^T D_t S_{t-1}) solve the unit-lower-triangular system
    u_t + beta_t sum_{s<t} A_ts u_s = beta_t (v_t - (k_t * e^{G_t})^T S_0),
    A_ts = sum_c k_t[c] k_s[c] e^{G_t[c] - G_s[c]},
then o_t = (q_t * e^{G_t})^T S_0 + sum_{s<=t} (sum_c q_t[c] k_s[c] e^{G_t[c]-G_s[c]}) u_s
and S_C = e^{G_C} * S_0 + sum_s (k_s * e^{G_C - G_s}) u_s^T.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import torch
import torch.nn.functional as F

from labkit.engine.compute.models.layers import l2_normalize, linear, rms_norm

Tensor = torch.Tensor


class KDAState(NamedTuple):
    conv_q: Tensor | None  # [K-1, h*dk] last pre-conv inputs (None when K == 0)
    conv_k: Tensor | None
    conv_v: Tensor | None
    recurrent: Tensor  # [h, dk, dv]


def kda_step(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor,
             beta: Tensor) -> tuple[Tensor, Tensor]:
    """One token: state `[..., h, dk, dv]`, q/k/g `[..., h, dk]`, v `[..., h, dv]`,
    beta `[..., h]` -> `(out [..., h, dv], new state)`. q must already be scaled."""
    s = state * torch.exp(g)[..., None]
    delta = v - torch.einsum("...hk,...hkv->...hv", k, s)
    s = s + torch.einsum("...hk,...hv->...hkv", k * beta[..., None], delta)
    return torch.einsum("...hk,...hkv->...hv", q, s), s


def kda_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                  state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """`kda_step` over a sequence `[T, h, ...]`; returns `(out [T, h, dv], state)`."""
    s = _zero_state(q, v) if state is None else state
    outs = []
    for t in range(q.shape[0]):
        o, s = kda_step(s, q[t], k[t], v[t], g[t], beta[t])
        outs.append(o)
    return torch.stack(outs) if outs else v.new_zeros(v.shape), s


def _zero_state(q: Tensor, v: Tensor) -> Tensor:
    return torch.zeros(q.shape[1], q.shape[2], v.shape[2], dtype=q.dtype, device=q.device)


def kda_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                state: Tensor | None = None, chunk_size: int = 16) -> tuple[Tensor, Tensor]:
    """The chunkwise-parallel form of `kda_recurrent` (same inputs and outputs)."""
    s = _zero_state(q, v) if state is None else state
    T = q.shape[0]
    outs = []
    for c0 in range(0, T, chunk_size):
        qc, kc, vc = q[c0:c0 + chunk_size], k[c0:c0 + chunk_size], v[c0:c0 + chunk_size]
        gc, bc = g[c0:c0 + chunk_size], beta[c0:c0 + chunk_size]
        C = qc.shape[0]
        G = gc.cumsum(0)  # [C, h, dk]
        diff = G[:, None] - G[None, :]  # [t, s, h, dk]: log-decay from s to t
        tri = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        strict = tri & ~torch.eye(C, dtype=torch.bool, device=q.device)
        ninf = torch.tensor(float("-inf"), dtype=q.dtype, device=q.device)
        e_strict = torch.exp(torch.where(strict[..., None, None], diff, ninf))
        e_incl = torch.exp(torch.where(tri[..., None, None], diff, ninf))
        A = torch.einsum("tshc,thc,shc->hts", e_strict, kc, kc)
        B = torch.einsum("tshc,thc,shc->hts", e_incl, qc, kc)
        eG = torch.exp(G)
        rhs = bc[..., None] * (vc - torch.einsum("thc,hcv->thv", kc * eG, s))  # [C, h, dv]
        M = torch.eye(C, dtype=q.dtype, device=q.device) + bc.T[:, :, None] * A  # [h, t, s]
        U = torch.linalg.solve_triangular(M, rhs.transpose(0, 1), upper=False,
                                          unitriangular=True)  # [h, C, dv]
        outs.append(torch.einsum("thc,hcv->thv", qc * eG, s)
                    + torch.einsum("hts,hsv->thv", B, U))
        decay_end = torch.exp(G[-1][None] - G)  # [C, h, dk]
        s = torch.exp(G[-1])[..., None] * s + torch.einsum("shc,hsv->hcv", kc * decay_end, U)
    return (torch.cat(outs) if outs else v.new_zeros(v.shape)), s


def short_conv(x: Tensor, weight: Tensor, conv_state: Tensor | None) -> tuple[Tensor, Tensor]:
    """Causal depthwise conv + SiLU: x `[T, C]`, weight `[C, 1, K]`, conv_state
    `[K-1, C]` (the previous inputs, zeros at a sequence start) -> `(y, new conv_state)`.
    `y_t = silu(sum_j weight[:, 0, j] * x_{t-K+1+j})`."""
    K = weight.shape[-1]
    if conv_state is None:
        conv_state = x.new_zeros(K - 1, x.shape[1])
    xx = torch.cat([conv_state, x], dim=0)  # [K-1+T, C]
    windows = xx.unfold(0, K, 1)  # [T, C, K]
    y = (windows * weight[:, 0, :]).sum(-1)
    return F.silu(y), xx[xx.shape[0] - (K - 1):]


def kda_initial_state(w: Mapping[str, Tensor], head_dim: int,
                      dtype: torch.dtype | None = None) -> KDAState:
    """The zero state of a fresh sequence, sized from the (possibly sliced) weights.

    Conv history in the weights' dtype; the recurrent state in `dtype` (default: the
    weights' dtype, float32 for half-precision weights, as served)."""
    proj = w["self_attn.q_proj.weight"]
    half = proj.dtype in (torch.float16, torch.bfloat16)
    dtype = dtype or (torch.float32 if half else proj.dtype)
    C, h = proj.shape[0], proj.shape[0] // head_dim
    conv = None
    if "self_attn.q_conv1d.weight" in w:
        K = w["self_attn.q_conv1d.weight"].shape[-1]
        conv = torch.zeros(K - 1, C, dtype=proj.dtype, device=proj.device)
    rec = torch.zeros(h, head_dim, head_dim, dtype=dtype, device=proj.device)
    return KDAState(conv, conv, conv, rec)


def kda_attention(x: Tensor, w: Mapping[str, Tensor], head_dim: int,
                  state: KDAState | None = None, eps: float = 1e-6,
                  chunk_size: int | None = 16) -> tuple[Tensor, KDAState]:
    """A whole KDA block on hidden x `[T, H]` continuing from `state` (None: a fresh
    sequence) -> `(out [T, H], new state)`. A TP rank passes its heads' slices and
    gets a partial sum of out. `chunk_size=None` steps token by token. The recurrence
    runs in float32 at least (half-precision inputs are widened, the state stays fp32)."""
    T, d = x.shape[0], head_dim
    state = state or kda_initial_state(w, d)
    qkv, conv = [], []
    for p, cs in zip("qkv", state[:3]):
        y = linear(x, w[f"self_attn.{p}_proj.weight"])
        if f"self_attn.{p}_conv1d.weight" in w:
            y, cs = short_conv(y, w[f"self_attn.{p}_conv1d.weight"], cs)
        else:
            y = F.silu(y)
        qkv.append(y.unflatten(-1, (-1, d)))
        conv.append(cs)
    q, k, v = qkv
    q = l2_normalize(q) / math.sqrt(d)
    k = l2_normalize(k)
    h = q.shape[1]
    f = linear(linear(x, w["self_attn.f_a_proj.weight"]), w["self_attn.f_b_proj.weight"])
    g = -torch.exp(w["self_attn.A_log"])[:, None] * F.softplus(
        f.view(T, h, d) + w["self_attn.dt_bias"].view(h, d))
    beta = torch.sigmoid(linear(x, w["self_attn.b_proj.weight"]))
    core = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    q, k, v, g, beta = (t.to(core) for t in (q, k, v, g, beta))
    rec = state.recurrent.to(core)
    if chunk_size is None:
        o, rec = kda_recurrent(q, k, v, g, beta, rec)
    else:
        o, rec = kda_chunked(q, k, v, g, beta, rec, chunk_size)
    o = o.to(x.dtype)
    gate = linear(linear(x, w["self_attn.g_a_proj.weight"]), w["self_attn.g_b_proj.weight"])
    o = rms_norm(o, w["self_attn.o_norm.weight"], eps) * torch.sigmoid(gate.view(T, h, d))
    out = linear(o.reshape(T, h * d), w["self_attn.o_proj.weight"])
    return out, KDAState(conv[0], conv[1], conv[2], rec)
