"""Torch references: the numerical ground truth of every kernel, and the CPU path.

Plain, vectorised torch (the gathers are batched; only the variable-length prefill
loops over requests). They compute in float32 whatever the input dtype, return
outputs in the query's dtype and log-sum-exps in float32, and never read a block-table
entry beyond a request's length, nor one wholly before a sliding window (such entries
may hold garbage, or -1).

These functions take already-validated arguments: call them through the public
functions of `labkit.kernels`, which check shapes, dtypes and devices and dispatch.
The conventions (shapes, masking, empty sequences) are documented there.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def window_start(query_pos: torch.Tensor, window: int) -> torch.Tensor:
    """First position a query at `query_pos` sees through a sliding window of `window`
    tokens (itself included); 0 when window is 0 (no window)."""
    first = query_pos.to(torch.int64) - window + 1
    return first.clamp_min(0) if window else torch.zeros_like(first)


def _paged_slots(block_table: torch.Tensor, lens: torch.Tensor, length: int, block_size: int,
                 first: torch.Tensor | None = None):
    """Physical slots (block * block_size + offset) of positions 0..length-1 of each row.

    Returns (slots[R, length] int64, valid[R, length] bool); a position is valid from
    the row's `first` (default 0) up to its length. Slots of invalid positions are 0, so
    garbage (or -1) in the table outside that range is never used as an index.
    """
    rows, width = block_table.shape
    pos = torch.arange(length, device=block_table.device)
    valid = pos[None, :] < lens.to(torch.int64)[:, None]
    if first is not None:
        valid &= pos[None, :] >= first[:, None]
    logical = (pos // block_size).clamp_max(max(width - 1, 0)).expand(rows, length)
    blocks = torch.gather(block_table.to(torch.int64), 1, logical)
    slots = torch.where(valid, blocks * block_size + pos % block_size, 0)
    return slots, valid


def _gather(cache: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """cache[NB, BS, ...] indexed by physical slots -> [*slots.shape, ...] in float32
    (works on views). Invalid entries are 0, whatever slot 0 holds: a masked score has
    p = 0, and 0 * NaN (stale or never-written memory) would still poison P @ V."""
    bs = cache.shape[1]
    x = cache[slots // bs, slots % bs].float()
    return x.masked_fill(~valid.reshape(valid.shape + (1,) * (x.dim() - valid.dim())), 0.0)


def _softmax_lse(scores: torch.Tensor, visible: torch.Tensor):
    """Masked softmax over the last dim; rows with nothing visible give p = 0, lse = -inf."""
    scores = scores.masked_fill(~visible, NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(scores - safe.unsqueeze(-1))
    return p, lse


def paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale, window=0):
    B, Hq, D = q.shape
    _, BS, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    out = torch.zeros_like(q)
    lse = torch.full((B, Hq), NEG_INF, dtype=torch.float32, device=q.device)
    length = int(seq_lens.max()) if B else 0
    if length == 0:
        return out, lse
    slots, valid = _paged_slots(block_table, seq_lens, length, BS,
                                window_start(seq_lens - 1, window))
    k = _gather(k_cache, slots, valid)  # [B, L, Hkv, D]
    v = _gather(v_cache, slots, valid)
    qf = q.float().view(B, Hkv, G, D)
    scores = torch.einsum("bhgd,blhd->bhgl", qf, k) * scale
    p, lse = _softmax_lse(scores, valid[:, None, None, :])
    o = torch.einsum("bhgl,blhd->bhgd", p, v)
    return o.reshape(B, Hq, D).to(q.dtype), lse.reshape(B, Hq)


def mla_paged_decode(q_latent, latent_cache, block_table, seq_lens, scale, kv_lora_rank):
    """q_latent [B, Q, H, Dc] (Q query tokens per request, causal at the end)."""
    B, Q, H, _ = q_latent.shape
    BS = latent_cache.shape[1]
    out = q_latent.new_zeros((B, Q, H, kv_lora_rank))
    lse = torch.full((B, Q, H), NEG_INF, dtype=torch.float32, device=q_latent.device)
    length = int(seq_lens.max()) if B else 0
    if length == 0:
        return out, lse
    slots, valid = _paged_slots(block_table, seq_lens, length, BS)
    c = _gather(latent_cache, slots, valid)  # [B, L, Dc]
    scores = torch.einsum("bqhc,blc->bqhl", q_latent.float(), c) * scale
    # query token j of a request sits at position seq_len - Q + j and sees keys <= it
    pos = torch.arange(length, device=q_latent.device)
    limit = seq_lens.to(torch.int64)[:, None] - Q + torch.arange(Q, device=q_latent.device)
    visible = valid[:, None, :] & (pos[None, None, :] <= limit[:, :, None])  # [B, Q, L]
    p, lse = _softmax_lse(scores, visible[:, :, None, :])
    o = torch.einsum("bqhl,blc->bqhc", p, c[..., :kv_lora_rank])
    return o.to(q_latent.dtype), lse


def merge_attn_states(outs, lses):
    m = lses.max(dim=0).values
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lses - safe)  # 0 for empty (-inf) shards
    total = w.sum(dim=0)
    parts = torch.where(w.unsqueeze(-1) > 0, outs.float(), torch.zeros((), device=outs.device))
    o = (parts * w.unsqueeze(-1)).sum(dim=0)
    has = total > 0
    o = o / torch.where(has, total, torch.ones_like(total)).unsqueeze(-1)
    lse = torch.where(has, safe + torch.log(torch.where(has, total, torch.ones_like(total))),
                      torch.full_like(total, NEG_INF))
    return o.to(outs.dtype), lse


def reshape_and_cache(k, v, k_cache, v_cache, slot_mapping):
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].to(torch.int64)
    BS = k_cache.shape[1]
    k_cache[slots // BS, slots % BS] = k[keep]
    if v is not None:
        v_cache[slots // BS, slots % BS] = v[keep]


def paged_prefill_attention(q, k_new, v_new, k_cache, v_cache, block_table, prefix_lens,
                            query_start_loc, scale, window=0):
    T, Hq, D = q.shape
    BS, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    out = torch.zeros_like(q)
    lse = torch.full((T, Hq), NEG_INF, dtype=torch.float32, device=q.device)
    starts = query_start_loc.tolist()
    plens = prefix_lens.tolist()
    for b in range(len(plens)):
        s, e, P = starts[b], starts[b + 1], plens[b]
        n = e - s
        if n == 0:
            continue
        # (cached positions before the first token's window are not read at all)
        slots, cached = _paged_slots(block_table[b:b + 1], prefix_lens[b:b + 1], P, BS,
                                     window_start(prefix_lens[b:b + 1], window))
        k = torch.cat([_gather(k_cache, slots[0], cached[0]), k_new[s:e].float()])
        v = torch.cat([_gather(v_cache, slots[0], cached[0]), v_new[s:e].float()])
        qf = q[s:e].float().view(n, Hkv, G, D)
        scores = torch.einsum("ihgd,jhd->hgij", qf, k) * scale  # [Hkv, G, n, P+n]
        i = torch.arange(n, device=q.device)[:, None]
        j = torch.arange(P + n, device=q.device)[None, :]
        visible = j < P + i + 1  # the whole prefix, then the new tokens causally
        if window:  # ... and only the last `window` positions
            visible &= j > P + i - window
        p, part_lse = _softmax_lse(scores, visible)
        o = torch.einsum("hgij,jhd->ihgd", p, v)
        out[s:e] = o.reshape(n, Hq, D).to(q.dtype)
        lse[s:e] = part_lse.permute(2, 0, 1).reshape(n, Hq)
    return out, lse


def sparse_topk_attention(q, latent_cache, topk_indices, block_table, token_to_req, scale,
                          kv_lora_rank):
    T, H, _ = q.shape
    BS = latent_cache.shape[1]
    width = block_table.shape[1]
    pos = topk_indices.to(torch.int64)
    valid = pos >= 0
    logical = torch.where(valid, pos // BS, 0).clamp_max(width - 1)
    rows = token_to_req.to(torch.int64)[:, None].expand_as(pos)
    blocks = block_table.to(torch.int64)[rows, logical]
    slots = torch.where(valid, blocks * BS + pos % BS, 0)
    c = _gather(latent_cache, slots, valid)  # [T, K, Dc]
    scores = torch.einsum("thc,tkc->thk", q.float(), c) * scale
    p, lse = _softmax_lse(scores, valid[:, None, :])
    o = torch.einsum("thk,tkc->thc", p, c[..., :kv_lora_rank])
    return o.to(q.dtype), lse
