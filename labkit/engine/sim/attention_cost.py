"""Attention pricing: what one attention layer's kernels cost a GPU, for a step's work.

The step model (`layer_model.py`) walks a stage's layers; this is its attention part,
the piece where layouts differ most:

- **projections**: the QKV and output GEMMs, which see only token counts. MLA adds
  its down-projections, and decode runs absorbed (queries into the latent space,
  outputs back out); DeepSeek-V3.2's indexer projections are replicated on every TP
  rank;
- **decode core**: every decoding request reads its context. The work carries the
  summed context of a rank's decodes, so the kernel is priced at the mean context
  (capped by a sliding window). DCP shards the context a GPU reads but hands it
  every head's queries (`dcp_heads`); DSA reads only its top-k entries, plus the
  indexer over the whole context;
- **prefill core**: each prefill chunk on its own shape (new tokens over its cached
  prefix), from `StepWork.prefill_chunks`, summed per step and rank in the order a
  single step adds them (`sum_chunks`), so a run's rows and its steps agree to the
  bit. PCP splits a chunk's queries and gathers its KV; sliding-window layers run a
  long chunk as window-sized pieces.

The collectives a layer adds (DCP's query gather and output merge, PCP's KV gather)
are the placement's (`Placement.comm_per_layer`), priced in `layer_model.py`.
"""

from __future__ import annotations

import numpy as np

from labkit.engine.layouts import Placement
from labkit.engine.step_work import StepWork


class AttentionCost:
    def __init__(self, placement: Placement, ops, width: int) -> None:
        """`ops`: the calibrated kernels (`CostModel`); `width`: query tokens per
        decoding request in a step (1 + drafts)."""
        self.model = m = placement.model
        self.layout = lay = placement.layout
        self.ops = ops
        self.width = width
        # fp8 checkpoints (DeepSeek, Kimi) run block-scaled fp8 GEMMs (DeepGEMM)
        self.wdtype = "fp8_block" if m.weight_dtype == "fp8" else "bf16"
        self.kv_dtype = placement.kv_dtype
        self.heads = m.num_heads / lay.tp  # query heads a TP rank owns
        # the placement's figures (a frozen placement: fixed)
        self.kv_heads = placement.kv_heads_per_gpu
        self.dcp_heads = placement.dcp_heads_per_gpu
        self.kv_per_layer = placement.kv_bytes_per_token_per_layer_per_gpu()
        # prefill chunks gather the whole KV (PCP, or DCP on an MLA model; see Placement)
        self.gathered = lay.pcp > 1 or placement.gathers_prefix_for_prefill()

    def projections(self, tokens, t_dec):
        """An attention layer's projections (GEMMs), which see only token counts."""
        m, ops, w = self.model, self.ops, self.wdtype
        h, heads = m.hidden_size, self.heads
        if m.is_mla:
            q_in = m.q_lora_rank or h
            proj = ops.gemm(tokens, heads * m.qk_head_dim, q_in, w)
            proj = proj + ops.gemm(tokens, m.kv_lora_rank + m.qk_rope_head_dim, h, w)
            if m.q_lora_rank:
                proj = proj + ops.gemm(tokens, m.q_lora_rank, h, w)
            proj = proj + ops.gemm(tokens, h, heads * m.v_head_dim, w)
            # decode runs absorbed: queries into latent space, outputs back out
            proj = proj + ops.gemm(t_dec * heads, m.kv_lora_rank, m.qk_nope_head_dim, "bf16")
            proj = proj + ops.gemm(t_dec * heads, m.v_head_dim, m.kv_lora_rank, "bf16")
            if m.has_indexer:  # replicated on every TP rank
                proj = proj + ops.gemm(tokens, m.index_num_heads * m.index_head_dim, q_in, w)
                proj = proj + ops.gemm(tokens, m.index_head_dim + m.index_num_heads, h, w)
        else:
            kv_heads = self.kv_heads
            proj = ops.gemm(tokens, (heads + 2 * kv_heads) * m.head_dim, h, w)
            proj = proj + ops.gemm(tokens, h, heads * m.head_dim, w)
        return proj

    @staticmethod
    def decoders(num_decode_reqs) -> tuple:
        """What the decode core needs of a step's counts (`decode_core`): the decoding
        requests of each rank, at least 1 (None when no rank decodes), and which ranks
        decode (None when all do)."""
        busy = num_decode_reqs > 0
        if not busy.any():
            return None, None
        return np.maximum(num_decode_reqs, 1.0), None if busy.all() else busy

    def decode_core(self, work: StepWork, decoders: tuple, window: int = 0):
        """Every decoding request reading its context; `decoders`: `decoders(...)` of
        the step's counts."""
        m, lay, ops = self.model, self.layout, self.ops
        safe_b, busy = decoders
        if safe_b is None:  # a prefill-only step (what np.where below would give)
            return np.zeros(work.num_decode_reqs.shape)
        context = work.decode_context
        if context.shape == (1, 1):  # one step of one rank: a number (see `_counts`)
            context = context[0, 0]
        ctx = context / safe_b
        if lay.dcp > 1:  # each GPU reads its shard
            ctx = ctx / lay.dcp
        if window:  # the mean context, capped (exact when all are past the window)
            ctx = np.minimum(ctx, window)
        heads = self.dcp_heads  # ...for every head sharing the shard
        if m.has_indexer:
            topk = np.minimum(ctx * lay.dcp, m.index_topk) / lay.dcp
            t = ops.sparse_attention(safe_b, self.width, np.maximum(topk, 1), heads,
                                     m.kv_lora_rank, m.qk_rope_head_dim, self.kv_dtype)
            t = t + ops.indexer(safe_b, self.width, np.maximum(ctx, 1), m.index_num_heads,
                                m.index_head_dim)
        elif m.is_mla:  # several query tokens per request make MLA decode compute-bound
            t = ops.mla_decode(safe_b, np.maximum(ctx, 1), heads, m.kv_lora_rank,
                               m.qk_rope_head_dim, self.kv_dtype, query_len=self.width)
        else:
            t = ops.attention_decode(safe_b, np.maximum(ctx, 1), heads,
                                     self.kv_heads, m.head_dim, self.kv_dtype)
        return t if busy is None else np.where(busy, t, 0.0)

    def prefill_core(self, work: StepWork, window: int = 0):
        if work.prefill_chunks is None or len(work.prefill_chunks[0]) == 0:
            return np.zeros(work.prefill_tokens.shape)
        m, lay, ops = self.model, self.layout, self.ops
        _, new, ctx, _ = work.prefill_chunks
        if window:
            return self._window_prefill_core(work, window)
        if len(new) == 1:  # one chunk: priced as numbers (numpy scalars), as one step's
            new, ctx = new[0], ctx[0]  # decode core is
        queries = new / lay.pcp  # PCP: balanced chunk pairs per rank
        # PCP ranks, and DCP ranks of an MLA model (see Placement), gather the whole KV
        # for their queries; otherwise DCP ranks attend over their own shards
        shard = 1 if self.gathered else lay.dcp
        prefix = (ctx + (new - queries) / 2) / shard
        heads = self.dcp_heads if shard > 1 else self.heads
        q = np.maximum(queries, 1)
        if m.has_indexer:
            topk = np.minimum(ctx + new / 2, m.index_topk) / shard
            t = ops.sparse_attention(1, q, np.maximum(topk, 1), heads, m.kv_lora_rank,
                                     m.qk_rope_head_dim, self.kv_dtype)
            t = t + ops.indexer(1, q, np.maximum(prefix, 1), m.index_num_heads,
                                m.index_head_dim)
            t = t + self._sparse_prefill_latent(q, (ctx + new) / shard)
        elif m.is_mla:
            t = ops.mla_prefill(1, q, prefix, heads, m.qk_nope_head_dim, m.qk_rope_head_dim,
                                m.v_head_dim, self.kv_dtype)
            # the cached latent is up-projected to keys and values for the chunk
            kv_tokens = (ctx + new) / shard
            t = t + ops.gemm(kv_tokens, self.heads * (m.qk_nope_head_dim + m.v_head_dim),
                             m.kv_lora_rank, "bf16")
        else:
            t = ops.attention_prefill(1, q, prefix, heads, self.kv_heads,
                                      m.head_dim, self.kv_dtype)
        return sum_chunks(work, t)

    def _sparse_prefill_latent(self, queries, kv_tokens):
        """What a DSA prefill chunk pays besides the sparse kernel and the indexer
        (issue 13, HOL study). vLLM's sparse MLA backends (FlashMLA sparse) run prefill
        in latent space like decode: the chunk's queries go through W_UK and its
        outputs through W_UV; the cached prefix is never up-projected per head (that is
        dense MLA's MHA path, whose cost grows with the prefix on every chunk). With an
        fp8 cache the request's latents are first dequantised into a bf16 workspace,
        a memory-bound pass over its whole context."""
        m, ops = self.model, self.ops
        rows = queries * self.heads
        t = ops.gemm(rows, m.kv_lora_rank, m.qk_nope_head_dim, "bf16")
        t = t + ops.gemm(rows, m.v_head_dim, m.kv_lora_rank, "bf16")
        if self.kv_dtype == "fp8":
            latent = m.kv_lora_rank + m.qk_rope_head_dim
            nbytes = kv_tokens * (self.kv_per_layer
                                  + 2.0 * latent)
            t = t + nbytes / (ops.hardware.hbm_bandwidth * ops.params.mla.memory_eff)
        return t

    def _window_prefill_core(self, work: StepWork, window: int):
        """Sliding-window prefill (GQA; DCP and PCP are refused for such models): a
        chunk longer than the window runs as pieces of `window` queries, each over at
        most a window of earlier keys."""
        m, ops = self.model, self.ops
        _, new, ctx, _ = work.prefill_chunks
        piece = np.minimum(new, window)
        pieces = new / np.maximum(piece, 1)
        prefix = np.where(new > window, window, np.minimum(ctx, window))
        t = pieces * ops.attention_prefill(1, np.maximum(piece, 1), prefix, self.heads,
                                           self.kv_heads, m.head_dim,
                                           self.kv_dtype)
        return sum_chunks(work, t)


def sum_chunks(work: StepWork, seconds) -> np.ndarray:
    """Per-chunk times (`prefill_chunks` order) summed per step and rank, for
    1/chunk_share. A run's row gets its own chunks added in the order its single step
    adds them, so it sums to the same bits."""
    rank, step = work.prefill_chunks[0], work.prefill_chunks[3]
    steps, ranks = work.prefill_tokens.shape
    # bincount adds the chunks in order into zeros, as np.add.at would, in one C loop
    if np.shape(seconds) != rank.shape:
        seconds = np.full(rank.shape, seconds)
    per_row = np.bincount(step * ranks + rank, weights=seconds, minlength=steps * ranks)
    per_row = per_row.reshape(steps, ranks)
    share = work.chunk_share  # (a number, or per rank for pipeline micro-batches)
    return per_row if isinstance(share, float) and share == 1.0 else per_row / share
