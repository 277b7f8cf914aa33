"""Compiled rows: a fast-forwarded run of one rank's steps priced in one compiled loop.

A run asks the step model for k steps at once. What a step's token counts decide —
GEMMs, MoE, collectives, graph dispatch, CPU time — is priced from the counts and
remembered (`LayerStepModel._count_pieces`; a run of decodes has the same counts in
every step, a prompt's chunks read theirs off a block, `count_blocks.py`), once per run
of equal steps (`equal_runs`), so a run whose chunk steps come before its decodes is
priced whole, in one call (`LayerStepModel.prices_runs_whole`). What is
left per step is the attention core over that step's contexts — every decoding
request's, and the prompt's chunk over its cached prefix — and the stage's sums: some
25-40 numpy calls on (k, 1) arrays, whose cost is the calls, not the arithmetic (~25
us in a tight loop, 65-160 us inside a replay, about the same for 1 step as for 1,000).

Here that per-step arithmetic is one compiled loop. It calls the very functions the
numpy path calls — `costmodel.attention.decode_seconds` and `prefill_seconds`,
`overheads.overlapped_step_s`, `curves.smooth_max`, registered with numba so that one
source serves both — and adds the stage's terms in the order `LayerStepModel._stage`
adds them, a row's chunks in the order `attention_cost.sum_chunks` adds them. numpy
applies each operation element by element, so step i's floats are the same IEEE
operations on the same numbers in both: the same bits (the cost model uses only + - *
/, sqrt, min and max for exactly this reason; numba fuses nothing without fastmath).
`tests/engine/test_compiled_rows.py` checks the two paths against each other.

It prices only what is exactly this loop: one rank (not lockstep), one pipeline stage,
GQA attention (no MLA, no indexer, no sliding-window layers), no DCP or PCP, graph
dispatch and CPU overheads modelled, collectives that do not read the context. Anything
else goes the numpy way.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from labkit.costmodel.attention import decode_seconds, kv_factor, prefill_seconds
from labkit.engine.sim.memo import MAX_ENTRIES
from labkit.engine.sim.overheads import overlapped_step_s
from labkit.engine.step_work import StepTiming
from labkit.specs.dtypes import dtype_bytes

_EMPTY = np.zeros(0, dtype=np.int64)
_MISSING = object()


class CompiledRows:
    """The numbers a step's attention cores and sums need besides its counts, fixed
    for a step model (those `CostModel.attention_decode` and `attention_prefill` would
    pass)."""

    def __init__(self, model) -> None:
        """`model`: a `LayerStepModel` for which `applies(model)` holds."""
        attn, ops, m = model.attention, model.ops, model.model
        dev, d, p = ops.device, ops.params.decode_attention, ops.params.prefill_attention
        self.model = model
        kv = attn.kv_dtype
        kv_bytes, head_dim = float(dtype_bytes(kv)), float(m.head_dim)
        self.decode = (float(attn.dcp_heads), float(attn.kv_heads), head_dim, kv_bytes,
                       kv_factor(kv, d.fp8_kv_factor), dev.hbm_bandwidth * d.memory_eff,
                       dev.sms, d.unit_s, d.launch_s)
        self.prefill = (float(attn.heads), float(attn.kv_heads), head_dim, head_dim, kv_bytes,
                        kv_factor(kv, p.fp8_kv_factor), dev.flops("bf16") * p.compute_eff,
                        dev.sms, p.softmax_dims, dev.hbm_bandwidth * p.memory_eff, p.unit_s,
                        p.launch_s)
        self.sums = (model.full_layers, model.overheads.params.step_gap_s,
                     model.overheads.async_scheduling)
        # a step's counts (as Python numbers) -> `_count_numbers` of its count pieces
        self._rows_by_counts: dict = {}
        self._compute_terms = len(model.kinds)  # a row's compute terms (`_count_terms`)

    @staticmethod
    def applies(model) -> bool:
        m, lay = model.model, model.layout
        return (model.overheads is not None and lay.pp == 1 and lay.dcp == 1
                and lay.pcp == 1 and not model.attention.gathered
                and not m.is_mla and not m.has_indexer and not model.window_layers
                and not model.comm_reads_context)

    def timing(self, work, counts) -> StepTiming | None:
        """The StepTiming of `work`, steps of one rank whose counts are `counts`
        (`LayerStepModel._counts`: numbers when every step has the same, else columns);
        None where the loop is not the numpy path."""
        chunks = work.prefill_chunks
        with_chunks = chunks is not None and len(chunks[0]) > 0
        if with_chunks and (len(chunks) != 4 or work.chunk_share != 1.0):
            return None
        found = self._numbers(counts)
        if found is None:
            return None
        numbers, index = found
        step, new, ctx = (chunks[3], chunks[1], chunks[2]) if with_chunks else \
            (_EMPTY, _EMPTY, _EMPTY)
        compute, comm, busy = _rows(work.decode_context[:, 0], numbers, index,
                                    self._compute_terms, with_chunks, step, new, ctx,
                                    *self.decode, *self.prefill, *self.sums)
        return StepTiming(busy=busy, compute=compute, comm=comm, duration=busy[:, 0].copy(),
                          temporary_kv_bytes=self.model._temporary_kv(work))

    def _numbers(self, counts):
        """(the count pieces' numbers of each run of equal steps, (runs, fields); each
        step's run, empty when one row serves all), or None if they are not all
        numbers."""
        if np.ndim(counts.prefill_tokens) == 0:
            row = self._row(tuple(x.item() for x in counts), counts)
            return None if row is None else (row, _EMPTY)
        columns = [c[:, 0] for c in counts]
        index, firsts = equal_runs(*columns)
        values = [c[firsts] for c in columns]
        rows = [self._row(key, values, i)
                for i, key in enumerate(zip(*(v.tolist() for v in values)))]
        if any(r is None for r in rows):
            return None
        return (rows[0] if len(rows) == 1 else np.concatenate(rows)), index

    def _row(self, key: tuple, counts, i: int | None = None):
        """The numbers row of a step whose counts have the values `key` (Python
        numbers), remembered by those values and the prefill count's type (an int, or a
        float share: the other counts' types are fixed). `counts`: the step's counts as
        numpy numbers, or (`i` given) columns whose element i they are — read only on a
        miss."""
        key = (type(key[0]), *key)
        found = self._rows_by_counts.get(key, _MISSING)
        if found is _MISSING:
            step = counts if i is None else [c[i] for c in counts]
            if len(self._rows_by_counts) >= MAX_ENTRIES:
                self._rows_by_counts.clear()
            model, blocks = self.model, self.model.count_blocks
            if blocks is not None and blocks.takes(False, step):
                found = blocks.numbers(step, self._count_numbers)  # (a block's row)
            else:
                found = self._count_numbers(
                    model._piece("counts", model._count_pieces, False, *step))
            self._rows_by_counts[key] = found
        return found

    @staticmethod
    def _count_numbers(fixed, rows: int = 1) -> np.ndarray | None:
        """A step's count pieces as one (1, fields) row — or a block's (`count_blocks.py`:
        (rows, 1) arrays, and numbers where no count changes them) as (rows, fields):
        its decoding requests (0: none), projections, LM head and drafts, an attention
        layer's collectives, CPU time, graph launches, then the stage's compute terms and
        comm terms; None if they are not all numbers (one per row)."""
        safe_b, busy = fixed.decoders
        compute_terms, comm_terms = fixed.terms
        fields = (0.0 if safe_b is None else safe_b, fixed.proj, fixed.extra,
                  fixed.attn_comm, fixed.cpu, fixed.launch, *compute_terms, *comm_terms)
        if busy is not None or any(x is None for x in fields):
            return None
        out = np.empty((rows, len(fields)))
        for j, x in enumerate(fields):
            x = np.asarray(x, dtype=np.float64)
            if x.ndim and (rows == 1 or x.shape != (rows, 1)):
                return None
            out[:, j] = x[:, 0] if x.ndim else x
        return out


@njit(cache=True)
def _rows(context, numbers, index, compute_terms, with_chunks, chunk_step, chunk_new, chunk_ctx,
          heads, kv_heads, head_dim, kv_bytes, fp8_factor, hbm_rate, sms, unit_s, launch_s,
          p_heads, p_kv_heads, qk_dim, v_dim, p_kv_bytes, p_fp8_factor, rate, p_sms,
          softmax_dims, p_hbm_rate, p_unit_s, p_launch_s, full_layers, gap, async_scheduling):
    """(compute, comm, busy) of each step, (k, 1): `context` the summed context of the
    rank's decoding requests in each step, `numbers` the count pieces (`_count_numbers`)
    and `index` each step's row of them (empty: row 0), the chunks' (step, new tokens,
    context) columns; the rest as the numpy path has it."""
    k = len(context)
    compute = np.empty((k, 1))
    comm = np.empty((k, 1))
    busy = np.empty((k, 1))
    fields = numbers.shape[1]
    c = 0  # the next chunk (listed step by step)
    for i in range(k):
        row = numbers[index[i] if len(index) else 0]
        batch, proj, extra, attn_comm, cpu, launch = row[0], row[1], row[2], row[3], row[4], \
            row[5]
        core = 0.0
        if batch > 0:
            ctx = np.maximum(context[i] / batch, 1.0)  # the mean context (`decode_core`)
            core = decode_seconds(batch, ctx, heads, kv_heads, head_dim, kv_bytes,
                                  fp8_factor, hbm_rate, sms, unit_s, launch_s)
        if with_chunks:  # the row's chunks, added in order to 0.0 (`sum_chunks`)
            prefill = 0.0
            while c < len(chunk_step) and chunk_step[c] == i:
                new = chunk_new[c] / 1.0  # (no PCP: every query is this rank's)
                prefix = (chunk_ctx[c] + (chunk_new[c] - new) / 2) / 1
                prefill = prefill + prefill_seconds(
                    1.0, np.maximum(new, 1.0), prefix, p_heads, p_kv_heads, qk_dim, v_dim,
                    p_kv_bytes, p_fp8_factor, rate, p_sms, softmax_dims, p_hbm_rate,
                    p_unit_s, p_launch_s)
                c += 1
            core = core + prefill
        total = full_layers * (proj + core)
        for j in range(6, 6 + compute_terms):
            total = total + row[j]
        total = total + extra
        wire = full_layers * attn_comm
        for j in range(6 + compute_terms, fields):
            wire = wire + row[j]
        compute[i, 0] = total
        comm[i, 0] = wire
        busy[i, 0] = overlapped_step_s(total + wire, cpu, launch, gap, async_scheduling)
    return compute, comm, busy


@njit(cache=True)
def equal_runs(prefill, decode, prefills, decodes, idle):
    """(for each step, the run of equal steps it belongs to; each run's first step) of
    a rank's step counts (`_Counts`' columns)."""
    k = len(prefill)
    index = np.empty(k, dtype=np.int64)
    firsts = np.empty(k, dtype=np.int64)
    runs = 0
    for i in range(k):
        if i == 0 or prefill[i] != prefill[i - 1] or decode[i] != decode[i - 1] \
                or prefills[i] != prefills[i - 1] or decodes[i] != decodes[i - 1] \
                or idle[i] != idle[i - 1]:
            firsts[runs] = i
            runs += 1
        index[i] = runs - 1
    return index, firsts[:runs]
