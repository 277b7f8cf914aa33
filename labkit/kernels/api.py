"""The public kernel functions: check arguments, pick the backend, run.

See the package docstring (`labkit.kernels`) for the conventions all of them share.
"""

from __future__ import annotations

import torch

from labkit.kernels import reference
from labkit.kernels._checks import FLOAT_DTYPES, INDEX_DTYPES, INT32, Checker
from labkit.kernels.dispatch import choose, triton_module

DEFAULT_KV_LORA_RANK = 512  # DeepSeek-V3 / Kimi-K2


def _triton(x: torch.Tensor):
    """The Triton module for tensors like x: compiled on CUDA, interpreted elsewhere."""
    return triton_module(interpret=x.device.type != "cuda")


def _first_read(first_query_pos: torch.Tensor, window: int) -> torch.Tensor | None:
    """Per request, the first cached position a sliding window lets its first query
    read (None without a window: position 0)."""
    return reference.window_start(first_query_pos, window) if window else None


def paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale, *,
                           window: int = 0, max_seq_len: int | None = None,
                           num_splits: int | None = None):
    """One query token per request against its paged K/V (GQA / MHA / MQA).

    q[B, Hq, D]; k_cache, v_cache[NB, BS, Hkv, D] (Hq % Hkv == 0; query head h reads KV
    head h // (Hq // Hkv)); block_table[B, MAXB] int32 (entries past a request's length
    are never read); seq_lens[B] int32 (0 = nothing to attend: an empty DCP shard);
    scale: softmax scale (usually D ** -0.5).

    `window` > 0 is a sliding window: the query, at position seq_len - 1, attends only
    positions seq_len - window .. seq_len - 1 (clamped at 0), and table entries of
    blocks wholly before that are never read (they may be -1: blocks the KV manager
    freed). Positions are the table's own, so a window needs an unsharded cache (no DCP).

    Returns out[B, Hq, D] in q's dtype and lse[B, Hq] float32, the natural-log
    log-sum-exp of the scaled scores; a request with seq_len 0 gets out 0, lse -inf.

    Keyword hints for the Triton path (ignored by the reference): `max_seq_len`, the
    longest seq_len as known on the host (default: MAXB * BS), sizes the split-KV grid
    (a wrong hint costs speed, never correctness); `num_splits` forces the number of KV
    chunks per request.
    """
    c = Checker("paged_decode_attention")
    c.tensor("q", q, "B,Hq,D", FLOAT_DTYPES)
    c.kv_cache_pair(k_cache, v_cache)
    c.tensor("block_table", block_table, "B,max_blocks", INT32)
    c.tensor("seq_lens", seq_lens, "B", INT32)
    scale = c.scale(scale)
    B, Hq, D = q.shape
    NB, BS, Hkv, _ = k_cache.shape
    c.same_dtype("k_cache", k_cache, "q", q)
    c.same_dtype("v_cache", v_cache, "q", q)
    c.dim("k_cache", k_cache, 3, "head_dim", D, "q's head_dim")
    c.same_shape("v_cache", v_cache, "k_cache", k_cache)
    if Hkv == 0 or Hq % Hkv:
        c.fail(f"q's {Hq} heads must be a multiple of k_cache's {Hkv} KV heads (GQA)")
    c.dim("block_table", block_table, 0, "batch", B, "q's batch")
    c.dim("seq_lens", seq_lens, 0, "batch", B, "q's batch")
    window = c.window(window)
    c.paged_lengths("seq_lens", seq_lens, block_table, BS, NB,
                    _first_read(seq_lens - 1, window) if c.on_cpu else None)
    if choose("paged_decode_attention", q.device) == "triton":
        return _triton(q).paged_decode_attention(
            q, k_cache, v_cache, block_table, seq_lens, scale, window=window,
            max_seq_len=max_seq_len, num_splits=num_splits)
    return reference.paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale,
                                            window)


def mla_paged_decode(q_latent, latent_cache, block_table, seq_lens, scale,
                     kv_lora_rank: int = DEFAULT_KV_LORA_RANK, *,
                     max_seq_len: int | None = None, num_splits: int | None = None):
    """MLA absorbed decode on the paged latent cache (DeepSeek-V3 / Kimi-K2).

    q_latent[B, H, Dl + Dr] — one query token per request — or [B, Q, H, Dl + Dr] — Q
    query tokens per request (speculative verify): token j sits at position
    seq_len - Q + j and sees the keys at positions <= its own (causal). Each query is
    already absorbed (W_UK folded in: q_nope @ W_UK, then the rope part).
    latent_cache[NB, BS, Dl + Dr]: one latent per token, shared by all heads; the key is
    the whole latent (kv_lora + rope dims), the value its first Dl = kv_lora_rank dims.
    block_table[B, MAXB] int32, seq_lens[B] int32 (0: an empty DCP shard).

    Returns out[B, H, Dl] (or [B, Q, H, Dl]) in q's dtype — still in latent space, the
    caller applies W_UV — and lse[B, H] (or [B, Q, H]) float32, natural log.
    The causal Q > 1 form assumes the cache holds the request's positions 0..seq_len-1
    (no DCP sharding: under DCP a rank's local keys are not contiguous positions).
    """
    c = Checker("mla_paged_decode")
    c.tensor("latent_cache", latent_cache, "num_blocks,block_size,Dl+Dr", FLOAT_DTYPES,
             last_contiguous=True)
    if isinstance(q_latent, torch.Tensor) and q_latent.dim() == 3:
        c.tensor("q_latent", q_latent, "B,H,Dl+Dr", FLOAT_DTYPES)
        q4, squeeze = q_latent.unsqueeze(1), True
    else:
        c.tensor("q_latent", q_latent, "B,Q,H,Dl+Dr", FLOAT_DTYPES)
        q4, squeeze = q_latent, False
    c.tensor("block_table", block_table, "B,max_blocks", INT32)
    c.tensor("seq_lens", seq_lens, "B", INT32)
    scale = c.scale(scale)
    B, Q, H, Dc = q4.shape
    NB, BS, _ = latent_cache.shape
    c.same_dtype("latent_cache", latent_cache, "q_latent", q_latent)
    c.dim("latent_cache", latent_cache, 2, "latent dim", Dc, "q_latent's last dim")
    c.kv_lora_rank(kv_lora_rank, Dc)
    c.dim("block_table", block_table, 0, "batch", B, "q_latent's batch")
    c.dim("seq_lens", seq_lens, 0, "batch", B, "q_latent's batch")
    c.paged_lengths("seq_lens", seq_lens, block_table, BS, NB)
    if choose("mla_paged_decode", q_latent.device) == "triton":
        out, lse = _triton(q_latent).mla_paged_decode(
            q4, latent_cache, block_table, seq_lens, scale, kv_lora_rank,
            max_seq_len=max_seq_len, num_splits=num_splits)
    else:
        out, lse = reference.mla_paged_decode(q4, latent_cache, block_table, seq_lens, scale,
                                              kv_lora_rank)
    if squeeze:
        return out.squeeze(1), lse.squeeze(1)
    return out, lse


def merge_attn_states(outs, lses):
    """Exact merge of N partial attention results over disjoint key sets (DCP shards,
    split-KV chunks, prefix + new tokens).

    outs[N, B, H, D] (float32/bfloat16/float16; a list of N [B, H, D] tensors is stacked),
    lses[N, B, H] float32 natural-log LSEs. Returns out[B, H, D] in outs' dtype and
    lse[B, H] float32: out = sum_i exp(lse_i - lse) out_i, lse = log sum_i exp(lse_i).
    Empty shards (lse -inf) contribute nothing, whatever their out holds (NaN included);
    all empty gives out 0, lse -inf.
    """
    c = Checker("merge_attn_states")
    if isinstance(outs, (list, tuple)):
        outs = torch.stack(list(outs))
    if isinstance(lses, (list, tuple)):
        lses = torch.stack(list(lses))
    c.tensor("outs", outs, "N,B,H,D", FLOAT_DTYPES)
    c.tensor("lses", lses, "N,B,H", (torch.float32,))
    if tuple(lses.shape) != tuple(outs.shape[:3]):
        c.fail(f"lses must have shape [N, B, H] = {tuple(outs.shape[:3])} (outs' first three "
               f"dims), got {tuple(lses.shape)}")
    if outs.shape[0] == 0:
        c.fail("outs must hold at least one partial result (N >= 1)")
    if choose("merge_attn_states", outs.device) == "triton":
        return _triton(outs).merge_attn_states(outs, lses)
    return reference.merge_attn_states(outs, lses)


def _check_slots(c: Checker, slot_mapping, T: int, capacity: int):
    c.tensor("slot_mapping", slot_mapping, "T", INDEX_DTYPES)
    c.dim("slot_mapping", slot_mapping, 0, "tokens", T, "one slot per token")
    if c.on_cpu and T:
        hi = int(slot_mapping.max())
        if hi >= capacity:
            c.fail(f"slot_mapping holds slot {hi} but the cache has {capacity} slots "
                   "(num_blocks * block_size)")


def reshape_and_cache(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Write each token's K and V into the paged cache, in place.

    k, v[T, Hkv, D]; k_cache, v_cache[NB, BS, Hkv, D] of the same dtype (strided views
    allowed, last dim contiguous); slot_mapping[T] int64 (or int32): token t goes to block
    slot // BS, offset slot % BS; a negative slot (-1) skips the token (one this rank does
    not own, e.g. under DCP). Slots must be distinct (else which write wins is undefined).
    """
    c = Checker("reshape_and_cache")
    c.tensor("k", k, "T,Hkv,D", FLOAT_DTYPES)
    c.tensor("v", v, "T,Hkv,D", FLOAT_DTYPES)
    c.kv_cache_pair(k_cache, v_cache)
    c.same_shape("v", v, "k", k)
    c.same_shape("v_cache", v_cache, "k_cache", k_cache)
    for name, x in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        c.same_dtype(name, x, "k", k)
    c.dim("k_cache", k_cache, 2, "Hkv", k.shape[1], "k's heads")
    c.dim("k_cache", k_cache, 3, "head_dim", k.shape[2], "k's head_dim")
    _check_slots(c, slot_mapping, k.shape[0], k_cache.shape[0] * k_cache.shape[1])
    if choose("reshape_and_cache", k.device) == "triton":
        _triton(k).reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
    else:
        reference.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)


def reshape_and_cache_latent(latent, latent_cache, slot_mapping) -> None:
    """MLA: write each token's latent (kv_lora + rope dims) into the paged latent cache,
    in place. latent[T, Dc]; latent_cache[NB, BS, Dc]; slot_mapping as reshape_and_cache."""
    c = Checker("reshape_and_cache_latent")
    c.tensor("latent", latent, "T,Dc", FLOAT_DTYPES)
    c.tensor("latent_cache", latent_cache, "num_blocks,block_size,Dc", FLOAT_DTYPES,
             last_contiguous=True)
    c.same_dtype("latent_cache", latent_cache, "latent", latent)
    c.dim("latent_cache", latent_cache, 2, "latent dim", latent.shape[1], "latent's dim")
    _check_slots(c, slot_mapping, latent.shape[0], latent_cache.shape[0] * latent_cache.shape[1])
    if choose("reshape_and_cache_latent", latent.device) == "triton":
        _triton(latent).reshape_and_cache(latent.unsqueeze(1), None, latent_cache.unsqueeze(2),
                                          None, slot_mapping)
    else:
        reference.reshape_and_cache(latent, None, latent_cache, None, slot_mapping)


def paged_prefill_attention(q, k_new, v_new, k_cache, v_cache, block_table, prefix_lens,
                            query_start_loc, scale, *, window: int = 0,
                            max_query_len: int | None = None):
    """Variable-length prefill (or chunked-prefill / multi-token step) over a paged prefix.

    Request b's new tokens are rows query_start_loc[b]:query_start_loc[b+1] of
    q[T, Hq, D], k_new[T, Hkv, D] and v_new[T, Hkv, D]. Each new token attends
    (1) all prefix_lens[b] tokens already in the cache, read through block_table[b]
    (k_cache, v_cache[NB, BS, Hkv, D]) — the new tokens' own K/V need not be in the
    cache (write them with reshape_and_cache, before or after) — and (2) the request's
    new tokens up to and including itself (causal).
    block_table[B, MAXB], prefix_lens[B], query_start_loc[B + 1] int32 with
    query_start_loc[0] = 0 and query_start_loc[B] = T.

    `window` > 0 is a sliding window: new token i of request b, at position
    p = prefix_lens[b] + i, attends only positions p - window + 1 .. p (cached or new);
    table entries of blocks wholly before prefix_lens[b] - window + 1 (the first
    token's window) are never read and may be -1.

    Returns out[T, Hq, D] in q's dtype and lse[T, Hq] float32 (natural log), so a
    result can be merged with others (merge_attn_states): e.g. prefix_lens all 0 gives
    plain causal attention over the new tokens. `max_query_len` (a host-side upper bound
    on the per-request new-token counts; it must not be too small) trims the Triton grid;
    default T.
    """
    c = Checker("paged_prefill_attention")
    c.tensor("q", q, "T,Hq,D", FLOAT_DTYPES)
    c.tensor("k_new", k_new, "T,Hkv,D", FLOAT_DTYPES)
    c.tensor("v_new", v_new, "T,Hkv,D", FLOAT_DTYPES)
    c.kv_cache_pair(k_cache, v_cache)
    c.tensor("block_table", block_table, "B,max_blocks", INT32)
    c.tensor("prefix_lens", prefix_lens, "B", INT32)
    c.tensor("query_start_loc", query_start_loc, "B+1", INT32)
    scale = c.scale(scale)
    T, Hq, D = q.shape
    NB, BS, Hkv, _ = k_cache.shape
    for name, x in (("k_new", k_new), ("v_new", v_new), ("k_cache", k_cache),
                    ("v_cache", v_cache)):
        c.same_dtype(name, x, "q", q)
    if tuple(k_new.shape) != (T, Hkv, D) or tuple(v_new.shape) != (T, Hkv, D):
        c.fail(f"k_new and v_new must have shape [T, Hkv, D] = {(T, Hkv, D)} (q's tokens, "
               f"k_cache's heads, q's head_dim), got {tuple(k_new.shape)} and "
               f"{tuple(v_new.shape)}")
    c.dim("k_cache", k_cache, 3, "head_dim", D, "q's head_dim")
    c.same_shape("v_cache", v_cache, "k_cache", k_cache)
    if Hkv == 0 or Hq % Hkv:
        c.fail(f"q's {Hq} heads must be a multiple of k_cache's {Hkv} KV heads (GQA)")
    B = block_table.shape[0]
    c.dim("prefix_lens", prefix_lens, 0, "batch", B, "block_table's rows")
    c.dim("query_start_loc", query_start_loc, 0, "batch + 1", B + 1, "block_table's rows + 1")
    window = c.window(window)
    c.paged_lengths("prefix_lens", prefix_lens, block_table, BS, NB,
                    _first_read(prefix_lens, window) if c.on_cpu else None)
    if c.on_cpu:
        qsl = query_start_loc.tolist()
        if qsl[0] != 0 or qsl[-1] != T or any(a > b for a, b in zip(qsl, qsl[1:])):
            c.fail(f"query_start_loc must rise from 0 to T = {T} (request b owns rows "
                   f"query_start_loc[b]:query_start_loc[b+1]), got {qsl}")
        longest = max((b - a for a, b in zip(qsl, qsl[1:])), default=0)
        if max_query_len is not None and max_query_len < longest:
            c.fail(f"max_query_len ({max_query_len}) is below the longest request's "
                   f"{longest} new tokens")
    if choose("paged_prefill_attention", q.device) == "triton":
        return _triton(q).paged_prefill_attention(
            q, k_new, v_new, k_cache, v_cache, block_table, prefix_lens, query_start_loc,
            scale, window=window, max_query_len=max_query_len)
    return reference.paged_prefill_attention(q, k_new, v_new, k_cache, v_cache, block_table,
                                             prefix_lens, query_start_loc, scale, window)


def sparse_topk_attention(q, latent_cache, topk_indices, block_table, token_to_req, scale,
                          kv_lora_rank: int = DEFAULT_KV_LORA_RANK):
    """DSA-style sparse MLA attention: each query attends only its selected positions.

    q[T, H, Dl + Dr] absorbed queries (any mix of prefill and decode tokens);
    latent_cache[NB, BS, Dl + Dr] as in mla_paged_decode; topk_indices[T, K] int32: the
    positions (in the token's request's sequence) that the indexer selected, -1 =
    padding, order irrelevant, duplicates count twice; block_table[B, MAXB] int32 and
    token_to_req[T] int32: token t belongs to request token_to_req[t], whose positions
    live in block_table[token_to_req[t]]. Causality is the indexer's business (it only
    selects positions <= the query's own).

    Returns out[T, H, Dl] in q's dtype and lse[T, H] float32; a token with no selected
    position gets out 0, lse -inf.
    """
    c = Checker("sparse_topk_attention")
    c.tensor("q", q, "T,H,Dl+Dr", FLOAT_DTYPES)
    c.tensor("latent_cache", latent_cache, "num_blocks,block_size,Dl+Dr", FLOAT_DTYPES,
             last_contiguous=True)
    c.tensor("topk_indices", topk_indices, "T,K", INT32)
    c.tensor("block_table", block_table, "B,max_blocks", INT32)
    c.tensor("token_to_req", token_to_req, "T", INT32)
    scale = c.scale(scale)
    T, H, Dc = q.shape
    NB, BS, _ = latent_cache.shape
    c.same_dtype("latent_cache", latent_cache, "q", q)
    c.dim("latent_cache", latent_cache, 2, "latent dim", Dc, "q's last dim")
    c.kv_lora_rank(kv_lora_rank, Dc)
    c.dim("topk_indices", topk_indices, 0, "tokens", T, "q's tokens")
    c.dim("token_to_req", token_to_req, 0, "tokens", T, "q's tokens")
    if c.on_cpu and T:
        B, width = block_table.shape
        lo, hi = int(token_to_req.min()), int(token_to_req.max())
        if lo < 0 or hi >= B:
            c.fail(f"token_to_req must name rows of block_table in [0, {B}), got {lo}..{hi}")
        valid = topk_indices >= 0
        if bool(valid.any()):
            top = int(topk_indices.max())
            if top >= width * BS:
                c.fail(f"topk_indices holds position {top} but block_table rows hold "
                       f"{width} blocks of {BS} tokens")
            rows = token_to_req.to(torch.int64)[:, None].expand_as(topk_indices)[valid]
            blocks = block_table[rows, (topk_indices[valid] // BS).to(torch.int64)]
            if bool(((blocks < 0) | (blocks >= NB)).any()):
                c.fail(f"a selected position maps to a block_table entry outside [0, {NB})")
    if choose("sparse_topk_attention", q.device) == "triton":
        return _triton(q).sparse_topk_attention(q, latent_cache, topk_indices,
                                                     block_table, token_to_req, scale,
                                                     kv_lora_rank)
    return reference.sparse_topk_attention(q, latent_cache, topk_indices, block_table,
                                           token_to_req, scale, kv_lora_rank)
