"""Attention on one rank, over its paged KV, for every family and layout.

Every function takes a rank's view of the step (`RankStep`), a layer's weights (this
rank's slice) and the normed hidden states of the rank's rows, and returns the rows'
attention output as a TP partial sum (the caller all-reduces). The pattern is the same
for each family:

1. project the rows' queries and the new tokens' KV entries;
2. PCP: all-gather the new KV entries of the other PCP ranks (every rank needs all of
   them); write the ones this rank owns (DCP: its token shard) into its paged cache;
3. attend, by one of two routes:
   - *local* (no DCP, no PCP, GQA): the prefill kernel over the cached prefix plus the
     new tokens (or the decode kernel when every request decodes one token);
   - *rows*: every query row attends its request's cached positions up to its own,
     as a one-token decode (`paged_decode_attention`, `mla_paged_decode`, or
     `sparse_topk_attention` for DSA). Under DCP a rank does this for the rows of its
     whole DCP group (all-gathered queries) over its own shard, the partial results
     go back to their owners, and each owner merges its N partials exactly with their
     log-sum-exps (`merge_attn_states`).
   MLA prefills instead gather their whole context latent (all-gathered from the DCP
   shards) and run the naive, up-projected form — absorbed decode, naive prefill, as
   DeepSeek serves it.

Sliding-window layers (gpt-oss; GQA, never with DCP) differ in two places only: their
KV goes to and is read from the pages of the request's *window table* (`step_batch`),
and the kernels get `window=spec.sliding_window`, so they neither attend nor read
anything before a query's window — whose blocks the KV manager has already freed.
"""

from __future__ import annotations

import numpy as np
import torch

from labkit.engine.compute.models.dsa import (
    dsa_select, indexer_k, indexer_q, indexer_scores, indexer_weights)
from labkit.engine.compute.models.family import family_config
from labkit.engine.compute.models.gqa import (
    gqa_output, gqa_qkv, gqa_scale, gqa_sinks, layer_window)
from labkit.engine.compute.models.kda import kda_attention
from labkit.engine.compute.models.layers import causal_mask
from labkit.engine.compute.models.mla import (
    mla_absorb_q, mla_attention_naive, mla_latent, mla_output, mla_q, mla_scale,
    mla_unabsorb_out)
from labkit.engine.compute.rank import RankStep
from labkit.kernels import (
    merge_attn_states, mla_paged_decode, paged_decode_attention, paged_prefill_attention,
    sparse_topk_attention)

Tensor = torch.Tensor


def attention(rs: RankStep, layer: int, w: dict, x: Tensor) -> Tensor:
    spec = rs.rank.spec
    if spec.is_linear_layer(layer):
        return linear_attention(rs, layer, w, x)
    if spec.is_mla:
        return mla_attention(rs, layer, w, x)
    return gqa_attention(rs, layer, w, x)


# ------------------------------------------------------------------------ GQA
def gqa_attention(rs: RankStep, layer: int, w: dict, x: Tensor) -> Tensor:
    spec, batch, kv = rs.rank.spec, rs.batch, rs.kv
    cfg = family_config(spec)
    pos = batch.tensor(rs.positions)
    q, k, v = gqa_qkv(x, w, spec.head_dim, pos, cfg.rope, cfg.rms_norm_eps)
    k_all, v_all = rs.all_tokens(k), rs.all_tokens(v)
    kv.write_kv(layer, k_all, v_all, rs.slots(layer))
    kc, vc = kv.layers[layer]["k"], kv.layers[layer]["v"]
    scale, window = gqa_scale(spec.head_dim), layer_window(spec, layer)
    if batch.pcp == 1 and kv.dcp == 1:
        out, lse = _gqa_local(rs, q, k, v, kc, vc, scale, window)
    else:  # (a window here means PCP without DCP: local positions are the table's)
        def partial(q_rows, rows):
            tables, lens = _row_tables(rs, rows, sliding=window > 0)
            return paged_decode_attention(q_rows, kc, vc, tables, lens, scale, window=window)
        out, lse = _rows_attention(rs, q, partial)
    return gqa_output(gqa_sinks(out, lse, w), w)


def _gqa_local(rs: RankStep, q, k, v, kc, vc, scale, window: int) -> Tensor:
    batch = rs.batch
    entries = batch.entries
    table = batch.tensor(batch.table(sliding=window > 0), torch.int32)
    if all(e.num_new == 1 for e in entries):
        lens = batch.tensor([e.context + 1 for e in entries], torch.int32)
        return paged_decode_attention(q, kc, vc, table, lens, scale, window=window)
    prefix = batch.tensor([e.context for e in entries], torch.int32)
    starts = batch.tensor(batch.query_start, torch.int32)
    return paged_prefill_attention(q, k, v, kc, vc, table, prefix, starts, scale,
                                   window=window)


# ---------------------------------------------------------------- row route
def _row_tables(rs: RankStep, rows: np.ndarray, sliding: bool = False) -> tuple[Tensor, Tensor]:
    """Block table and local length (owned positions <= the row's) of each row."""
    batch = rs.batch
    lens = rs.kv.local_len(batch.positions[rows] + 1)
    return (batch.tensor(batch.tables_of(rows, sliding), torch.int32),
            batch.tensor(lens, torch.int32))


def _rows_attention(rs: RankStep, q_rows: Tensor, partial, extra: Tensor | None = None,
                    decode_only: bool = False) -> tuple[Tensor, Tensor]:
    """Each of my rows (or my decode rows) attends its context: over my shard, or over
    the DCP group's shards with an exact merge; returns `(out, lse)` of my rows.
    `partial(q, rows[, extra])` -> (out, lse) over my shard for the given token rows
    (any number, possibly none)."""
    is_decode = rs.batch.is_decode_row
    members = [r[is_decode[r]] if decode_only else r for r in rs.dcp_rows]
    rows_all = np.concatenate(members)
    q_all = rs.dcp_gather_rows(q_rows)
    args = (q_all, rows_all) if extra is None else (q_all, rows_all, rs.dcp_gather_rows(extra))
    out, lse = partial(*args)
    sizes = [len(m) for m in members]
    outs = rs.dcp_return_rows(out, sizes)
    lses = rs.dcp_return_rows(lse, sizes)
    if len(outs) == 1:
        return outs[0], lses[0]
    return merge_attn_states(torch.stack(outs), torch.stack(lses))


# ------------------------------------------------------------------------ MLA
def mla_attention(rs: RankStep, layer: int, w: dict, x: Tensor) -> Tensor:
    """MLA (+ the DSA indexer): naive over the gathered context for prompt rows,
    absorbed over the paged latent for decode rows."""
    spec, batch, kv = rs.rank.spec, rs.batch, rs.kv
    pos = batch.tensor(rs.positions)
    q_nope, q_pe, qr = mla_q(x, w, spec, pos)
    latent = mla_latent(x, w, spec, pos)
    kv.write(layer, "latent", rs.all_tokens(latent), rs.slots(layer))
    kv_b = w["self_attn.kv_b_proj.weight"]
    selected = None
    if spec.has_indexer:
        ik = indexer_k(x, w, spec, pos)
        kv.write(layer, "index_k", rs.all_tokens(ik), rs.slots(layer))
        selected = _dsa_selection(rs, layer, w, x, qr, pos)
    out = x.new_zeros(x.shape[0], q_nope.shape[1], spec.v_head_dim)
    decode = batch.is_decode_row[rs.rows]
    prompt_entries = sorted({int(e) for e in batch.entry_of[rs.rows[~decode]]})
    _mla_prefill(rs, layer, q_nope, q_pe, kv_b, selected, prompt_entries, out)
    d_idx = torch.as_tensor(np.nonzero(decode)[0], dtype=torch.long, device=x.device)
    if batch.is_decode_row.any():  # every DCP member joins the collectives
        q_abs = torch.cat([mla_absorb_q(q_nope[d_idx], kv_b, spec), q_pe[d_idx]], dim=-1)
        o_lat = _mla_decode(rs, layer, q_abs, decode, selected)
        out[d_idx] = mla_unabsorb_out(o_lat, kv_b, spec)
    return mla_output(out, w)


def _mla_prefill(rs, layer, q_nope, q_pe, kv_b, selected, entries, out) -> None:
    spec, batch = rs.rank.spec, rs.batch
    all_prompt = sorted({int(e) for e in batch.entry_of[~batch.is_decode_row]})
    contexts = dict(zip(all_prompt, rs.context(layer, "latent", all_prompt)))
    for e in entries:
        mine = np.nonzero((batch.entry_of[rs.rows] == e))[0]
        idx = torch.as_tensor(mine, dtype=torch.long, device=q_nope.device)
        ctx = contexts[e]
        qpos = batch.tensor(rs.positions[mine])
        mask = causal_mask(qpos, torch.arange(ctx.shape[0], device=ctx.device))
        if selected is not None:
            mask = selected[e]
        out[idx] = mla_attention_naive(q_nope[idx], q_pe[idx], ctx, kv_b, spec, mask)[0]


def _mla_decode(rs, layer, q_abs, decode_rows, selected) -> Tensor:
    spec, kv = rs.rank.spec, rs.kv
    cache = kv.layers[layer]["latent"]
    scale, r = mla_scale(spec), spec.kv_lora_rank
    if selected is None:
        def partial(q_rows, rows):
            tables, lens = _row_tables(rs, rows)
            return mla_paged_decode(q_rows, cache, tables, lens, scale, kv_lora_rank=r)
        return _rows_attention(rs, q_abs, partial, decode_only=True)[0]
    topk = _topk_positions(rs, selected, decode_rows)

    def sparse(q_rows, rows, positions):
        pos = positions.cpu().numpy()
        local = np.where((pos >= 0) & kv.owned(np.maximum(pos, 0)),
                         kv.local_index(np.maximum(pos, 0)), -1)
        tables, _ = _row_tables(rs, rows)
        to_req = torch.arange(len(rows), dtype=torch.int32, device=q_rows.device)
        return sparse_topk_attention(q_rows, cache, rs.batch.tensor(local, torch.int32),
                                     tables, to_req, scale, kv_lora_rank=r)
    return _rows_attention(rs, q_abs, sparse, topk, decode_only=True)[0]


# ------------------------------------------------------------------------ DSA
def _dsa_selection(rs: RankStep, layer, w, x, qr, pos) -> dict[int, Tensor]:
    """Per entry with rows here: the `[my rows of it, context]` mask of the positions
    the indexer picks (causal, top-k)."""
    spec, batch = rs.rank.spec, rs.batch
    iq, iw = indexer_q(qr, w, spec, pos), indexer_weights(x, w, spec)
    entries = list(range(len(batch.entries)))
    keys = rs.context(layer, "index_k", entries)
    out = {}
    for e in sorted({int(e) for e in batch.entry_of[rs.rows]}):
        mine = np.nonzero(batch.entry_of[rs.rows] == e)[0]
        idx = torch.as_tensor(mine, dtype=torch.long, device=x.device)
        k = keys[e]
        kpos = torch.arange(k.shape[0], device=x.device)
        scores = indexer_scores(iq[idx], k, iw[idx])
        out[e] = dsa_select(scores, causal_mask(pos[idx], kpos), spec.index_topk)
    return out


def _topk_positions(rs: RankStep, selected: dict, decode_rows: np.ndarray) -> Tensor:
    """The selected positions of my decode rows `[rows, index_topk]`, -1 padded."""
    batch, k = rs.batch, rs.rank.spec.index_topk
    rows = rs.rows[decode_rows]
    out = torch.full((len(rows), k), -1, dtype=torch.int32)
    for i, row in enumerate(rows):
        e = int(batch.entry_of[row])
        j = int(np.nonzero(rs.rows[batch.entry_of[rs.rows] == e] == row)[0][0])
        picked = torch.nonzero(selected[e][j]).flatten()
        out[i, : len(picked)] = picked.to(torch.int32)
    return out.to(batch.device)


# ------------------------------------------------------------- linear (KDA)
def linear_attention(rs: RankStep, layer: int, w: dict, x: Tensor) -> Tensor:
    """KDA: each request's tokens run through its recurrent state, in order. Under PCP
    the rows are all-gathered first (a recurrence cannot be split by token). A
    decoding request steps token by token, keeping the state after each one: the
    next step continues from the state at the accepted length."""
    spec, batch, states = rs.rank.spec, rs.batch, rs.rank.linear
    eps = family_config(spec).rms_norm_eps
    xs = rs.all_tokens(x)
    outs = []
    for e in batch.entries:
        xe = xs[e.start:e.start + e.num_new]
        state = states.get(layer, e.request_id, e.context)
        if e.decode and e.num_new > 1:
            parts = []
            for t in range(e.num_new):
                o, state = kda_attention(xe[t:t + 1], w, spec.linear_head_dim, state, eps)
                states.put(layer, e.request_id, e.context + t + 1, state)
                parts.append(o)
            outs.append(torch.cat(parts))
        else:  # cut at the marks, so the state there is kept (linear_state.py)
            parts, start = [], 0
            for stop in [m - e.context for m in e.state_marks] + [e.num_new]:
                o, state = kda_attention(xe[start:stop], w, spec.linear_head_dim, state, eps)
                states.put(layer, e.request_id, e.context + stop, state)
                parts.append(o)
                start = stop
            outs.append(torch.cat(parts) if len(parts) > 1 else parts[0])
    full = torch.cat(outs) if outs else x.new_zeros(0, x.shape[1])
    return rs.my_rows(full)
