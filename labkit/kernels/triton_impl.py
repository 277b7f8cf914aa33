"""Triton kernels: the CUDA path (on CPU, tests run them under Triton's interpreter).

Imported lazily by `labkit.kernels.dispatch`. Whether `triton.jit` builds compiled or
interpreted kernels is decided when this module is imported, from TRITON_INTERPRET; the
dispatcher loads a second, interpreted copy when CPU tensors need one (see there).
That is why the @jit kernels and their host-side launchers share this one file: the
interpreted copy is this file executed again, and `aot` records launches by swapping
the `*_kernel` names here; launchers in another module would call the compiled kernels.
Kernels call no @jit function of triton.language (tl.sum, tl.max, tl.zeros are such):
an interpreted kernel cannot call those when triton.language itself was imported in
compiled mode, which any earlier `import triton` (torch imports it too) fixes for good.

Shared conventions:
- softmax in base 2: scores are scaled by `scale * log2(e)`, `exp2` everywhere, the
  log-sum-exp converted back to natural log (times ln 2) when stored;
- accumulation in float32; P is cast to the value dtype before the P@V dot (as
  FlashAttention does); fp32 inputs use IEEE dots (no TF32);
- a row that sees no key keeps m = -inf; `m_use` (0 where m = -inf) keeps
  exp2(-inf - -inf) from making NaN, and such rows end with out = 0, lse = -inf;
- paged reads gather per token: position t of request b lives in physical block
  block_table[b, t // BLOCK_SIZE] at offset t % BLOCK_SIZE, so any page size works and
  table entries beyond a request's length are never read;
- sliding windows (`window` > 0, GQA decode and prefill): the KV loops start at the
  window's first position instead of 0, so blocks that left the window are never
  loaded (their table entries may be -1); a partial first tile is masked per row;
- address arithmetic in int64 (a 128K x 256 cache has more than 2^31 elements);
- caches may be strided views (e.g. K and V interleaved in one packed buffer); only
  their last dimension must be contiguous.

Split-KV decode (flash-decoding): a long context is cut into `num_splits` chunks of
whole BLOCK_N tiles, one program per (request, head group, chunk), each writing a
partial output and its LSE to fp32 scratch; `_merge_kernel` (the same code as
`merge_attn_states`) combines them. With one split the kernel writes the final output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def interpreted() -> bool:
    """Were this module's kernels built for the interpreter (TRITON_INTERPRET=1)?"""
    return type(_merge_kernel).__name__ == "InterpretedFunction"


# --------------------------------------------------------------------------- kernels


# Reductions through tl.reduce with Triton's own combine functions: what tl.sum / tl.max
# compile to, but callable from a kernel interpreted in a process whose triton.language
# was imported in compiled mode (tl.sum and tl.max are themselves @jit functions there,
# which the interpreter cannot call; it recognises these combine functions and reduces
# with numpy). Likewise tl.full instead of tl.zeros.
_SUM_COMBINE = tl.standard._sum_combine
_MAX_COMBINE = tl.standard._elementwise_max


@triton.jit
def _sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _SUM_COMBINE)


@triton.jit
def _max(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _MAX_COMBINE)


@triton.jit
def _dot(a, b, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b accumulated in fp32. UPCAST (set only under the interpreter, whose dot
    multiplies bfloat16 operands as raw uint16 bits) computes in fp32 instead; bf16 x bf16
    products are exact in fp32, so the result equals the tensor-core one up to summation
    order."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=DOT_PREC)


@triton.jit
def _online_softmax_step(s, m_i, l_i, acc):
    """One tile of online softmax (base 2). s[M, N] already scaled and masked with -inf.

    Returns (p, m_new, l_new, acc_scaled): the caller adds p @ V to acc_scaled.
    """
    m_new = tl.maximum(m_i, _max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_new = l_i * alpha + _sum(p, 1)
    return p, m_new, l_new, acc * alpha[:, None]


@triton.jit
def _finish(m_i, l_i, acc):
    """(out, lse natural log); rows that saw nothing give (0, -inf)."""
    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    return out, lse


@triton.jit
def _gqa_decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, sl_ptr, o_ptr, lse_ptr,
    scale_log2, chunk, window,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_btb,
    stride_os, stride_ob, stride_oh,
    stride_ls, stride_lb,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """Program (request b, KV head, split): the G query heads sharing that KV head are the
    rows of one [BLOCK_G, D] tile (GQA packing: each K/V tile is read once for the group).
    A sliding window (window > 0) moves the chunks' origin to the window's first
    position: nothing before it is loaded, table entries included."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(sl_ptr + b)
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    start = lo + split * chunk
    # the last chunk runs to the end, so a too-small max_seq_len hint costs speed, not
    # correctness
    end = tl.where(split == tl.num_programs(2) - 1, seq_len, tl.minimum(start + chunk, seq_len))

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < G
    d_mask = offs_d < HEAD_DIM
    heads = kvh * G + offs_g
    b64 = b.to(tl.int64)

    q = tl.load(q_ptr + b64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_G], 0, tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0, tl.float32)
    k_head = kvh.to(tl.int64) * stride_kh
    v_head = kvh.to(tl.int64) * stride_vh

    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        blk = tl.load(bt_ptr + b64 * stride_btb + pos // PAGE, mask=n_mask, other=0).to(tl.int64)
        off = (pos % PAGE).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + (blk * stride_kb + off * stride_ks + k_head)[:, None] + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), DOT_PREC, UPCAST) * scale_log2
        s = tl.where(n_mask[None, :], s, float("-inf"))
        p, m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc)
        v = tl.load(v_ptr + (blk * stride_vb + off * stride_vs + v_head)[:, None] + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        acc += _dot(p.to(v.dtype), v, DOT_PREC, UPCAST)

    out, lse = _finish(m_i, l_i, acc)
    split64 = split.to(tl.int64)
    tl.store(o_ptr + split64 * stride_os + b64 * stride_ob + heads[:, None] * stride_oh
             + offs_d[None, :], out, mask=g_mask[:, None] & d_mask[None, :])
    tl.store(lse_ptr + split64 * stride_ls + b64 * stride_lb + heads, lse, mask=g_mask)


@triton.jit
def _mla_decode_kernel(
    q_ptr, c_ptr, bt_ptr, sl_ptr, o_ptr, lse_ptr,
    scale_log2, chunk, Q, H,
    stride_qb, stride_qq, stride_qh,
    stride_cb, stride_cs,
    stride_btb,
    stride_os, stride_ob, stride_oq, stride_oh,
    stride_ls, stride_lb, stride_lq,
    D_LORA: tl.constexpr, D_ROPE: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """Program (row block, request b, split). Rows are (query token j, head h) pairs, all
    sharing the request's latent cache; each latent tile [BLOCK_N, Dl+Dr] is loaded once
    and serves as key (all dims) and value (first Dl dims). Row (j, h) sits at position
    seq_len - Q + j and sees keys at positions <= it (causal speculative verify)."""
    rb = tl.program_id(0)  # row blocks of one request run next to each other (L2 reuse)
    b = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(sl_ptr + b)
    start = split * chunk
    # the last chunk runs to the end, so a too-small max_seq_len hint costs speed, not
    # correctness
    end = tl.where(split == tl.num_programs(2) - 1, seq_len, tl.minimum(start + chunk, seq_len))

    rows = rb * BLOCK_H + tl.arange(0, BLOCK_H)
    r_mask = rows < Q * H
    j = rows // H
    h = rows % H
    limit = seq_len - Q + j + 1  # keys visible to the row: positions < limit
    offs_l = tl.arange(0, BLOCK_L)
    l_mask = offs_l < D_LORA
    offs_n = tl.arange(0, BLOCK_N)
    b64 = b.to(tl.int64)

    q_row = b64 * stride_qb + j.to(tl.int64) * stride_qq + h.to(tl.int64) * stride_qh
    q_nope = tl.load(q_ptr + q_row[:, None] + offs_l[None, :],
                     mask=r_mask[:, None] & l_mask[None, :], other=0.0)
    if D_ROPE > 0:
        offs_r = tl.arange(0, BLOCK_R)
        r_dim = offs_r < D_ROPE
        q_pe = tl.load(q_ptr + q_row[:, None] + D_LORA + offs_r[None, :],
                       mask=r_mask[:, None] & r_dim[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_H], 0, tl.float32)
    acc = tl.full([BLOCK_H, BLOCK_L], 0, tl.float32)

    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        blk = tl.load(bt_ptr + b64 * stride_btb + pos // PAGE, mask=n_mask, other=0).to(tl.int64)
        base = blk * stride_cb + (pos % PAGE).to(tl.int64) * stride_cs
        kv = tl.load(c_ptr + base[:, None] + offs_l[None, :],
                     mask=n_mask[:, None] & l_mask[None, :], other=0.0)
        s = _dot(q_nope, tl.trans(kv), DOT_PREC, UPCAST)
        if D_ROPE > 0:
            kpe = tl.load(c_ptr + base[:, None] + D_LORA + offs_r[None, :],
                          mask=n_mask[:, None] & r_dim[None, :], other=0.0)
            s += _dot(q_pe, tl.trans(kpe), DOT_PREC, UPCAST)
        s = s * scale_log2
        visible = n_mask[None, :] & (pos[None, :] < limit[:, None])
        s = tl.where(visible, s, float("-inf"))
        p, m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc)
        acc += _dot(p.to(kv.dtype), kv, DOT_PREC, UPCAST)

    out, lse = _finish(m_i, l_i, acc)
    o_row = (split.to(tl.int64) * stride_os + b64 * stride_ob + j.to(tl.int64) * stride_oq
             + h.to(tl.int64) * stride_oh)
    tl.store(o_ptr + o_row[:, None] + offs_l[None, :], out,
             mask=r_mask[:, None] & l_mask[None, :])
    l_row = split.to(tl.int64) * stride_ls + b64 * stride_lb + j.to(tl.int64) * stride_lq + h
    tl.store(lse_ptr + l_row, lse, mask=r_mask)


@triton.jit
def _merge_kernel(
    o_ptr, lse_ptr, out_ptr, out_lse_ptr, N,
    stride_on, stride_ob, stride_oh,
    stride_ln, stride_lb,
    stride_xb, stride_xh,
    stride_yb,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (b, h): out = sum_i w_i out_i / sum_i w_i with w_i = exp(lse_i - max lse).
    Empty shards (lse = -inf) get weight 0 and their outputs are not even read (so garbage
    or NaN there cannot leak); all empty gives out = 0, lse = -inf."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    lse = tl.load(lse_ptr + offs_n * stride_ln + b * stride_lb + h, mask=n_mask,
                  other=float("-inf")).to(tl.float32)
    m = _max(lse, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(n_mask, tl.exp(lse - m_use), 0.0)
    total = _sum(w, 0)
    inv = 1.0 / tl.where(total > 0.0, total, 1.0)
    use = w > 0.0
    for d0 in range(0, HEAD_DIM, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        o = tl.load(o_ptr + offs_n[:, None] * stride_on + b * stride_ob + h * stride_oh
                    + offs_d[None, :], mask=use[:, None] & d_mask[None, :], other=0.0)
        merged = _sum(o.to(tl.float32) * w[:, None], 0) * inv
        tl.store(out_ptr + b * stride_xb + h * stride_xh + offs_d, merged, mask=d_mask)
    tl.store(out_lse_ptr + b * stride_yb + h,
             tl.where(total > 0.0, m_use + tl.log(tl.where(total > 0.0, total, 1.0)),
                      float("-inf")))


@triton.jit
def _cache_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, H,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, HAS_V: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (token t, head block): copy k[t] (and v[t]) to slot_mapping[t]; slot -1
    (or any negative slot) writes nothing."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    blk = slot // PAGE
    off = slot % PAGE
    # (the scalar is broadcast before the comparison: the interpreter mis-types
    # `scalar_bool & tensor_bool` masks)
    owned = (tl.full([BLOCK_H], 0, tl.int64) + slot) >= 0
    mask = (owned & (heads < H))[:, None] & (offs_d[None, :] < HEAD_DIM)
    h64 = heads.to(tl.int64)[:, None]
    x = tl.load(k_ptr + t * stride_kt + h64 * stride_kh + offs_d[None, :], mask=mask)
    tl.store(kc_ptr + blk * stride_kcb + off * stride_kcs + h64 * stride_kch + offs_d[None, :],
             x, mask=mask)
    if HAS_V:
        y = tl.load(v_ptr + t * stride_vt + h64 * stride_vh + offs_d[None, :], mask=mask)
        tl.store(vc_ptr + blk * stride_vcb + off * stride_vcs + h64 * stride_vch
                 + offs_d[None, :], y, mask=mask)


@triton.jit
def _prefill_kernel(
    q_ptr, kn_ptr, vn_ptr, kc_ptr, vc_ptr, bt_ptr, pl_ptr, qsl_ptr, o_ptr, lse_ptr,
    scale_log2, window,
    stride_qt, stride_qh,
    stride_knt, stride_knh, stride_vnt, stride_vnh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    stride_btb,
    stride_ot, stride_oh, stride_lt,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    WINDOWED: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """Program (request b, query tile, query head): BLOCK_M of b's new tokens attend
    (1) b's whole cached prefix through the block table, then (2) b's new tokens up to the
    tile's last row, causally. Tiles past the request's end do nothing.
    WINDOWED (a sliding window of `window` tokens): both loops start at the tile's first
    row's window start, so earlier blocks are never loaded (nor their table entries), and
    the partial tiles are masked per row (row r sees positions > its own - window)."""
    b = tl.program_id(0)
    mt = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // G
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    m0 = mt * BLOCK_M
    active = m0 < q_len
    prefix = tl.where(active, tl.load(pl_ptr + b), 0)
    new_hi = tl.where(active, tl.minimum(q_len, m0 + BLOCK_M), 0)

    rows = m0 + tl.arange(0, BLOCK_M)
    r_mask = rows < q_len
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    t_rows = (q_start + rows).to(tl.int64)
    h64 = h.to(tl.int64)
    q = tl.load(q_ptr + t_rows[:, None] * stride_qt + h64 * stride_qh + offs_d[None, :],
                mask=r_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0, tl.float32)
    kc_head = kvh.to(tl.int64) * stride_kch
    vc_head = kvh.to(tl.int64) * stride_vch

    # (1) the cached prefix: every position is visible to every new token (unless
    # windowed: new row r, at position prefix + r, sees positions > prefix + r - window)
    p_lo = 0
    if WINDOWED:
        p_lo = tl.maximum(prefix + m0 - window + 1, 0)
    for n0 in range(p_lo, prefix, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < prefix
        blk = tl.load(bt_ptr + b.to(tl.int64) * stride_btb + pos // PAGE, mask=n_mask,
                      other=0).to(tl.int64)
        off = (pos % PAGE).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(kc_ptr + (blk * stride_kcb + off * stride_kcs + kc_head)[:, None]
                    + offs_d[None, :], mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), DOT_PREC, UPCAST) * scale_log2
        seen = n_mask[None, :]
        if WINDOWED:
            seen = seen & (pos[None, :] > prefix + rows[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        p, m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc)
        v = tl.load(vc_ptr + (blk * stride_vcb + off * stride_vcs + vc_head)[:, None]
                    + offs_d[None, :], mask=kv_mask, other=0.0)
        acc += _dot(p.to(v.dtype), v, DOT_PREC, UPCAST)

    # (2) the new tokens, causally (new token i sees new tokens 0..i)
    kn_head = kvh.to(tl.int64) * stride_knh
    vn_head = kvh.to(tl.int64) * stride_vnh
    n_lo = 0
    if WINDOWED:
        n_lo = tl.maximum(m0 - window + 1, 0)
    for n0 in range(n_lo, new_hi, BLOCK_N):
        cols = n0 + offs_n
        n_mask = cols < new_hi
        t_cols = (q_start + cols).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(kn_ptr + (t_cols * stride_knt + kn_head)[:, None] + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), DOT_PREC, UPCAST) * scale_log2
        seen = n_mask[None, :] & (cols[None, :] <= rows[:, None])
        if WINDOWED:
            seen = seen & (cols[None, :] > rows[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        p, m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc)
        v = tl.load(vn_ptr + (t_cols * stride_vnt + vn_head)[:, None] + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        acc += _dot(p.to(v.dtype), v, DOT_PREC, UPCAST)

    out, lse = _finish(m_i, l_i, acc)
    tl.store(o_ptr + t_rows[:, None] * stride_ot + h64 * stride_oh + offs_d[None, :], out,
             mask=r_mask[:, None] & d_mask[None, :])
    tl.store(lse_ptr + t_rows * stride_lt + h, lse, mask=r_mask)


@triton.jit
def _sparse_kernel(
    q_ptr, c_ptr, idx_ptr, bt_ptr, req_ptr, o_ptr, lse_ptr,
    scale_log2, H, K,
    stride_qt, stride_qh,
    stride_cb, stride_cs,
    stride_it, stride_btb,
    stride_ot, stride_oh, stride_lt,
    D_LORA: tl.constexpr, D_ROPE: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """Program (query token t, head block): attend the K positions selected for t (-1 =
    padding) in its request's paged latent cache: a gather of BLOCK_N latent rows per
    step, each used as key (all dims) and value (first Dl dims) by all heads of the block."""
    t = tl.program_id(0).to(tl.int64)  # tokens on grid x: up to 2^31 - 1 of them
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < H
    req = tl.load(req_ptr + t).to(tl.int64)
    offs_l = tl.arange(0, BLOCK_L)
    l_mask = offs_l < D_LORA
    offs_n = tl.arange(0, BLOCK_N)
    q_row = t * stride_qt + heads.to(tl.int64) * stride_qh
    q_nope = tl.load(q_ptr + q_row[:, None] + offs_l[None, :],
                     mask=h_mask[:, None] & l_mask[None, :], other=0.0)
    if D_ROPE > 0:
        offs_r = tl.arange(0, BLOCK_R)
        r_dim = offs_r < D_ROPE
        q_pe = tl.load(q_ptr + q_row[:, None] + D_LORA + offs_r[None, :],
                       mask=h_mask[:, None] & r_dim[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_H], 0, tl.float32)
    acc = tl.full([BLOCK_H, BLOCK_L], 0, tl.float32)

    for k0 in range(0, K, BLOCK_N):
        kk = k0 + offs_n
        pos = tl.load(idx_ptr + t * stride_it + kk, mask=kk < K, other=-1)
        valid = pos >= 0
        blk = tl.load(bt_ptr + req * stride_btb + pos // PAGE, mask=valid, other=0).to(tl.int64)
        base = blk * stride_cb + (pos % PAGE).to(tl.int64) * stride_cs
        kv = tl.load(c_ptr + base[:, None] + offs_l[None, :],
                     mask=valid[:, None] & l_mask[None, :], other=0.0)
        s = _dot(q_nope, tl.trans(kv), DOT_PREC, UPCAST)
        if D_ROPE > 0:
            kpe = tl.load(c_ptr + base[:, None] + D_LORA + offs_r[None, :],
                          mask=valid[:, None] & r_dim[None, :], other=0.0)
            s += _dot(q_pe, tl.trans(kpe), DOT_PREC, UPCAST)
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
        p, m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc)
        acc += _dot(p.to(kv.dtype), kv, DOT_PREC, UPCAST)

    out, lse = _finish(m_i, l_i, acc)
    tl.store(o_ptr + (t * stride_ot + heads.to(tl.int64) * stride_oh)[:, None] + offs_l[None, :],
             out, mask=h_mask[:, None] & l_mask[None, :])
    tl.store(lse_ptr + t * stride_lt + heads, lse, mask=h_mask)


# --------------------------------------------------------------------------- launchers


def _p2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(int(n)))


def _dot_args(dtype: torch.dtype) -> dict:
    """fp32 inputs: IEEE dots (no TF32). Under the interpreter bf16 dots are computed in
    fp32 (see `_dot`)."""
    upcast = dtype == torch.bfloat16 and interpreted()
    return {"DOT_PREC": "ieee" if dtype == torch.float32 or upcast else "tf32",
            "UPCAST": upcast}


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: a few splits, so tests exercise the split path


def _num_splits(programs: int, max_len: int, block_n: int, device, requested: int | None) -> int:
    """How many KV chunks to cut each request into: enough programs to fill the GPU about
    twice over, chunks of at least 2 tiles, at most 256. The fp32 scratch this needs,
    splits x B x H x D, stays near 2 x SMs x (rows per program) x D: a few MB."""
    if requested is not None:
        return max(1, int(requested))
    tiles = triton.cdiv(max(max_len, 1), block_n)
    want = triton.cdiv(2 * _sm_count(device), max(programs, 1))
    return max(1, min(want, tiles // 2, 256))


def _merge(parts: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor):
    """parts [N, B, H, D], part_lse [N, B, H] -> out [B, H, D], lse [B, H] (all strided ok,
    last dims contiguous)."""
    N, B, H, D = parts.shape
    if B == 0 or H == 0:
        return
    block_n = _p2(N, 1)
    block_d = min(_p2(D), max(16, 4096 // block_n))
    _merge_kernel[(B, H)](
        parts, part_lse, out, lse, N,
        parts.stride(0), parts.stride(1), parts.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        HEAD_DIM=D, BLOCK_N=block_n, BLOCK_D=block_d,
    )


def merge_attn_states(outs, lses):
    N, B, H, D = outs.shape
    out = torch.empty((B, H, D), dtype=outs.dtype, device=outs.device)
    lse = torch.empty((B, H), dtype=torch.float32, device=outs.device)
    _merge(outs.contiguous(), lses.contiguous(), out, lse)
    return out, lse


def paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale, *, window=0,
                           max_seq_len=None, num_splits=None):
    B, Hq, D = q.shape
    _, PAGE, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    q = q.contiguous()
    fp32 = q.element_size() > 2  # IEEE fp32 dots run on FMA units: smaller tiles, more warps
    block_n = 16 if fp32 else 64
    block_g = _p2(G)
    bound = max_seq_len if max_seq_len is not None else block_table.shape[1] * PAGE
    if window:  # the chunks split the window, not the whole context
        bound = min(bound, window)
    splits = _num_splits(B * Hkv, bound, block_n, q.device, num_splits)
    chunk = triton.cdiv(triton.cdiv(max(bound, 1), splits), block_n) * block_n
    out = torch.empty_like(q)
    lse = torch.empty((B, Hq), dtype=torch.float32, device=q.device)
    if B == 0:
        return out, lse
    if splits == 1:
        parts, part_lse = out.unsqueeze(0), lse.unsqueeze(0)
    else:
        parts = torch.empty((splits, B, Hq, D), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((splits, B, Hq), dtype=torch.float32, device=q.device)
    _gqa_decode_kernel[(B, Hkv, splits)](
        q, k_cache, v_cache, block_table, seq_lens, parts, part_lse,
        scale * LOG2E, chunk, window,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        parts.stride(0), parts.stride(1), parts.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        G=G, HEAD_DIM=D, PAGE=PAGE, BLOCK_G=block_g, BLOCK_D=_p2(D), BLOCK_N=block_n,
        **_dot_args(q.dtype), num_warps=8 if fp32 and D > 64 else 4, num_stages=2,
    )
    if splits > 1:
        _merge(parts, part_lse, out, lse)
    return out, lse


def mla_paged_decode(q_latent, latent_cache, block_table, seq_lens, scale, kv_lora_rank, *,
                     max_seq_len=None, num_splits=None):
    """q_latent [B, Q, H, Dc] -> out [B, Q, H, Dl], lse [B, Q, H]."""
    B, Q, H, Dc = q_latent.shape
    PAGE = latent_cache.shape[1]
    Dl, Dr = kv_lora_rank, Dc - kv_lora_rank
    q_latent = q_latent.contiguous()
    rows = Q * H
    fp32 = q_latent.element_size() > 2
    block_h = 16 if rows <= 16 or fp32 else 32
    block_n = 16 if fp32 else 32
    row_blocks = triton.cdiv(rows, block_h)
    bound = max_seq_len if max_seq_len is not None else block_table.shape[1] * PAGE
    splits = _num_splits(B * row_blocks, bound, block_n, q_latent.device, num_splits)
    chunk = triton.cdiv(triton.cdiv(max(bound, 1), splits), block_n) * block_n
    out = torch.empty((B, Q, H, Dl), dtype=q_latent.dtype, device=q_latent.device)
    lse = torch.empty((B, Q, H), dtype=torch.float32, device=q_latent.device)
    if B == 0 or rows == 0:
        return out, lse
    if splits == 1:
        parts, part_lse = out.unsqueeze(0), lse.unsqueeze(0)
    else:
        parts = torch.empty((splits, B, Q, H, Dl), dtype=torch.float32, device=q_latent.device)
        part_lse = torch.empty((splits, B, Q, H), dtype=torch.float32, device=q_latent.device)
    _mla_decode_kernel[(row_blocks, B, splits)](
        q_latent, latent_cache, block_table, seq_lens, parts, part_lse,
        scale * LOG2E, chunk, Q, H,
        q_latent.stride(0), q_latent.stride(1), q_latent.stride(2),
        latent_cache.stride(0), latent_cache.stride(1),
        block_table.stride(0),
        parts.stride(0), parts.stride(1), parts.stride(2), parts.stride(3),
        part_lse.stride(0), part_lse.stride(1), part_lse.stride(2),
        D_LORA=Dl, D_ROPE=Dr, PAGE=PAGE, BLOCK_H=block_h, BLOCK_L=_p2(Dl),
        BLOCK_R=_p2(max(Dr, 1)), BLOCK_N=block_n, **_dot_args(q_latent.dtype),
        num_warps=8 if Dl >= 256 else 4, num_stages=2,
    )
    if splits > 1:
        _merge(parts.view(splits, B, Q * H, Dl), part_lse.view(splits, B, Q * H),
               out.view(B, Q * H, Dl), lse.view(B, Q * H))
    return out, lse


def reshape_and_cache(k, v, k_cache, v_cache, slot_mapping):
    """k, v [T, H, D] (v may be None: latent, one tensor) into caches [NB, BS, H, D]."""
    T, H, D = k.shape
    if T == 0:
        return
    k = k.contiguous()
    has_v = v is not None
    v = v.contiguous() if has_v else k
    vc = v_cache if has_v else k_cache
    block_d = _p2(D)
    block_h = max(1, min(triton.next_power_of_2(H), max(1, 4096 // block_d)))
    _cache_kernel[(T, triton.cdiv(H, block_h))](
        k, v, k_cache, vc, slot_mapping.contiguous(), H,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        vc.stride(0), vc.stride(1), vc.stride(2),
        HEAD_DIM=D, PAGE=k_cache.shape[1], HAS_V=has_v, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4,
    )


def paged_prefill_attention(q, k_new, v_new, k_cache, v_cache, block_table, prefix_lens,
                            query_start_loc, scale, *, window=0, max_query_len=None):
    T, Hq, D = q.shape
    PAGE, Hkv = k_cache.shape[1], k_cache.shape[2]
    B = prefix_lens.shape[0]
    q, k_new, v_new = q.contiguous(), k_new.contiguous(), v_new.contiguous()
    out = torch.empty_like(q)
    lse = torch.empty((T, Hq), dtype=torch.float32, device=q.device)
    if T == 0 or B == 0:
        return out, lse
    fp32 = q.element_size() > 2
    block_m = 32 if fp32 or D > 128 else 64
    block_n = 16 if fp32 else (32 if D > 128 else 64)
    max_q = T if max_query_len is None else max(1, min(int(max_query_len), T))
    _prefill_kernel[(B, triton.cdiv(max_q, block_m), Hq)](
        q, k_new, v_new, k_cache, v_cache, block_table, prefix_lens, query_start_loc, out, lse,
        scale * LOG2E, window,
        q.stride(0), q.stride(1),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        out.stride(0), out.stride(1), lse.stride(0),
        G=Hq // Hkv, HEAD_DIM=D, PAGE=PAGE, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_p2(D),
        WINDOWED=window > 0, **_dot_args(q.dtype), num_warps=8 if fp32 else 4, num_stages=2,
    )
    return out, lse


def sparse_topk_attention(q, latent_cache, topk_indices, block_table, token_to_req, scale,
                          kv_lora_rank):
    T, H, Dc = q.shape
    K = topk_indices.shape[1]
    Dl, Dr = kv_lora_rank, Dc - kv_lora_rank
    q = q.contiguous()
    topk_indices = topk_indices.contiguous()
    out = torch.empty((T, H, Dl), dtype=q.dtype, device=q.device)
    lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    if T == 0 or H == 0:
        return out, lse
    fp32 = q.element_size() > 2
    block_h = 16 if H <= 16 or fp32 else 32
    block_n = 16 if fp32 else 32
    _sparse_kernel[(T, triton.cdiv(H, block_h))](
        q, latent_cache, topk_indices, block_table, token_to_req, out, lse,
        scale * LOG2E, H, K,
        q.stride(0), q.stride(1),
        latent_cache.stride(0), latent_cache.stride(1),
        topk_indices.stride(0), block_table.stride(0),
        out.stride(0), out.stride(1), lse.stride(0),
        D_LORA=Dl, D_ROPE=Dr, PAGE=latent_cache.shape[1], BLOCK_H=block_h, BLOCK_L=_p2(Dl),
        BLOCK_R=_p2(max(Dr, 1)), BLOCK_N=block_n, **_dot_args(q.dtype),
        num_warps=8 if Dl >= 256 else 4, num_stages=2,
    )
    return out, lse

