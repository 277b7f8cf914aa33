"""Random paged-KV test cases and independent naive float64 attention.

`pack_sequences` lays out per-request contiguous tensors in a paged cache the way the
KV manager would: shuffled (non-contiguous) physical blocks, optionally a request that
reuses another's first physical blocks (prefix sharing / fork), and a block table wider
than needed whose extra entries are garbage (negative, or far beyond the cache).

`naive_*` gather with Python loops over positions and do the math in float64: code that
shares nothing with `labkit.kernels.reference`.
"""

from __future__ import annotations

import math

import torch

GARBAGE = (-7, 10**6, -1, 2**30)


def rand(g, *shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)


def cdiv(a, b):
    return -(-a // b)


def pack_sequences(seqs, block_size, g, *, share=None, extra_blocks=3, extra_cols=2,
                   dtype=None, device="cpu"):
    """seqs: list of per-request tensors [L_b, *feat] (or lists of such, packed alike:
    e.g. (k, v) pairs). share=(child, parent, n): request `child` reuses `parent`'s first
    n physical blocks (its content there must equal the parent's; the caller sees to it).

    Returns (caches, block_table int32 [B, width], lens int32 [B]); `caches` is one cache
    [NB, BS, *feat] per tensor in a request's entry.
    """
    seqs = [s if isinstance(s, (list, tuple)) else [s] for s in seqs]
    lens = [int(s[0].shape[0]) for s in seqs]
    need = [cdiv(L, block_size) for L in lens]
    shared = share[2] if share else 0
    num_blocks = sum(need) - shared + extra_blocks
    perm = torch.randperm(num_blocks, generator=g).tolist()
    rows, nxt = [], 0
    for b, n in enumerate(need):
        if share and b == share[0]:
            row = rows[share[1]][:shared] + perm[nxt:nxt + n - shared]
            nxt += n - shared
        else:
            row = perm[nxt:nxt + n]
            nxt += n
        rows.append(row)
    width = max(need, default=0) + extra_cols
    table = torch.empty((len(seqs), width), dtype=torch.int32)
    for b, row in enumerate(rows):
        for c in range(width):
            table[b, c] = row[c] if c < len(row) else GARBAGE[(b + c) % len(GARBAGE)]
    caches = []
    for i in range(len(seqs[0]) if seqs else 0):
        feat = seqs[0][i].shape[1:]
        cache = rand(g, num_blocks, block_size, *feat, dtype=dtype or seqs[0][i].dtype)
        for b, s in enumerate(seqs):
            for t in range(lens[b]):
                cache[rows[b][t // block_size], t % block_size] = s[i][t]
        caches.append(cache.to(device))
    return caches, table.to(device), torch.tensor(lens, dtype=torch.int32, device=device)


def gqa_case(g, lens, Hq, Hkv, D, BS, dtype, *, share=None, device="cpu"):
    """Random q and K/V sequences packed into paged caches; request share[0] repeats the
    first share[2] blocks of request share[1] (same content, same physical blocks)."""
    ks = [rand(g, L, Hkv, D, dtype=dtype) for L in lens]
    vs = [rand(g, L, Hkv, D, dtype=dtype) for L in lens]
    if share:
        child, parent, n = share
        m = n * BS
        ks[child][:m], vs[child][:m] = ks[parent][:m], vs[parent][:m]
    (kc, vc), table, sl = pack_sequences(list(zip(ks, vs)), BS, g, share=share, device=device)
    q = rand(g, len(lens), Hq, D, dtype=dtype, device=device)
    return q, kc, vc, table, sl, ks, vs


# ----------------------------------------------------------------- naive float64 math


def naive_gather(cache, row, length):
    """The first `length` positions of a request, one Python index at a time."""
    bs = cache.shape[1]
    if length == 0:
        return cache.new_zeros((0, *cache.shape[2:])).double()
    return torch.stack([cache[int(row[t // bs]), t % bs] for t in range(length)]).double()


def naive_attention(q, k, v, scale, visible=None):
    """q[n, Hq, D], k[L, Hkv, Dk], v[L, Hkv, Dv] -> out[n, Hq, Dv], lse[n, Hq] in float64.
    visible[n, L] bool (default all). Rows that see nothing: out 0, lse -inf."""
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    n, Hq, _ = q.shape
    L, Hkv = k.shape[0], k.shape[1]
    G = Hq // Hkv
    out = torch.zeros(n, Hq, v.shape[-1], dtype=torch.float64)
    lse = torch.full((n, Hq), -math.inf, dtype=torch.float64)
    if visible is None:
        visible = torch.ones(n, L, dtype=torch.bool)
    for h in range(Hq):
        kh, vh = k[:, h // G], v[:, h // G]
        for i in range(n):
            cols = visible[i].nonzero().flatten()
            if len(cols) == 0:
                continue
            s = (kh[cols] @ q[i, h]) * scale
            mx = s.max()
            e = torch.exp(s - mx)
            lse[i, h] = mx + torch.log(e.sum())
            out[i, h] = (e / e.sum()) @ vh[cols]
    return out, lse


def tol(dtype):
    """(atol, rtol) for outputs in `dtype` against float64 math."""
    return {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3),
            torch.bfloat16: (1.6e-2, 1.6e-2)}[dtype]


def assert_close(actual, expected, dtype, what=""):
    atol, rtol = tol(dtype)
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), atol=atol,
                               rtol=rtol, msg=lambda m: f"{what}: {m}")


def assert_lse(actual, expected, what="", atol=1e-4):
    """LSEs are float32 from float32 scores: tight, whatever the input dtype."""
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), atol=atol,
                               rtol=1e-5, msg=lambda m: f"{what} lse: {m}")


# ------------------------------------------------------------------ sliding windows


def poison_before(caches, table, first, block_size, mode):
    """Make every cached position before `first[b]` (request b's first visible one)
    unreadable: a kernel that reads any of them gets NaN (or an invalid block id).

    Whole blocks before the window get table entry -1 (mode "minus1", as the KV manager
    leaves freed sliding-window blocks) or point at an all-NaN block (mode "nan_block");
    the stale positions of the window's first, partial block are set to NaN in place.
    Every other position stays as written. Returns the modified table (a copy).
    """
    table = table.clone()
    used = {int(x) for b, f in enumerate(first) for x in table[b, f // block_size:]}
    spare = next(i for i in range(caches[0].shape[0]) if i not in used)
    for cache in caches:
        cache[spare] = float("nan")
    for b, f in enumerate(first):
        whole = f // block_size
        table[b, :whole] = -1 if mode == "minus1" else spare
        for cache in caches:
            if f % block_size:
                cache[int(table[b, whole]), : f % block_size] = float("nan")
    return table


def window_visible(n, prefix, window):
    """[n, prefix + n] bool: new token i (position prefix + i) sees positions
    prefix + i - window < j <= prefix + i."""
    i = torch.arange(n)[:, None] + prefix
    j = torch.arange(prefix + n)[None, :]
    return (j <= i) & (j > i - window)
