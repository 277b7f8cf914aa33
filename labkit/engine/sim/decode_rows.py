"""Decode rows: a fast-forwarded run of decode steps priced in one compiled loop.

A run of decodes (`run_plan.decode_work`) asks the step model for k steps whose token
counts are all the same; only the context the requests read grows. What the counts
decide — GEMMs, MoE, collectives, graph dispatch, CPU time — is priced once and
remembered (`LayerStepModel._count_pieces`). What is left per step is the attention
core over that step's context and the stage's sums: some 25 numpy calls on (k, 1)
arrays, whose cost is the calls, not the arithmetic (~25 us a run in a tight loop,
~65 us inside a replay, about the same for 10 steps as for 1,000).

Here that per-step arithmetic is one compiled loop. It calls the very functions the
numpy path calls — `costmodel.attention.decode_seconds`, `overheads.overlapped_step_s`,
`curves.smooth_max`, registered with numba so that one source serves both — and adds
the stage's terms in the order `LayerStepModel._stage` adds them. numpy applies each
operation element by element, so step i's floats are the same IEEE operations on the
same numbers in both: the same bits (the cost model uses only + - * /, sqrt and
max for exactly this reason; numba fuses nothing without fastmath).
`tests/engine/test_decode_rows.py` checks the two paths against each other.

It prices only what is exactly this loop: one rank (not lockstep), one pipeline stage,
GQA attention (no MLA, no indexer, no sliding-window layers), no DCP, graph dispatch
and CPU overheads modelled, collectives that do not read the context, every step
decoding. Anything else goes the numpy way.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from labkit.costmodel.attention import decode_seconds, kv_factor
from labkit.engine.sim.memo import MAX_ENTRIES
from labkit.engine.sim.overheads import overlapped_step_s
from labkit.engine.step_work import StepTiming
from labkit.specs.dtypes import dtype_bytes


class DecodeRows:
    """The numbers a decode step's attention core and sums need besides its counts,
    fixed for a step model (those `CostModel.attention_decode` would pass)."""

    def __init__(self, model) -> None:
        """`model`: a `LayerStepModel` for which `applies(model)` holds."""
        attn, ops, m = model.attention, model.ops, model.model
        dev, p = ops.device, ops.params.decode_attention
        self.model = model
        kv = attn.kv_dtype
        self.core = (float(attn.dcp_heads), float(attn.kv_heads), float(m.head_dim),
                     float(dtype_bytes(kv)), kv_factor(kv, p.fp8_kv_factor),
                     dev.hbm_bandwidth * p.memory_eff, dev.sms, p.unit_s, p.launch_s)
        self.gap = model.overheads.params.step_gap_s
        self.async_scheduling = model.overheads.async_scheduling
        self._numbers: dict = {}  # id(count pieces) -> (them, *`_step_numbers` of them)

    @staticmethod
    def applies(model) -> bool:
        m, lay = model.model, model.layout
        return (model.overheads is not None and lay.pp == 1 and lay.dcp == 1
                and not m.is_mla and not m.has_indexer and not model.window_layers
                and not model.comm_reads_context)

    def timing(self, work, fixed) -> StepTiming | None:
        """The StepTiming of `work`, steps of one rank whose count pieces are `fixed`
        (the memo's, numbers); None where the loop is not the numpy path."""
        # (an entry holds its pieces alive, so their id is not another's meanwhile)
        found = self._numbers.get(id(fixed))
        if found is None or found[0] is not fixed:
            if len(self._numbers) >= MAX_ENTRIES:
                self._numbers.clear()
            found = self._numbers[id(fixed)] = (fixed, *self._step_numbers(fixed))
        _, numbers, comm_s = found
        if numbers is None:
            return None
        compute, busy = _rows(work.decode_context[:, 0], *numbers)
        comm = np.empty(compute.shape)
        comm[...] = comm_s  # (a number: as the numpy path fills its array)
        return StepTiming(busy=busy, compute=compute, comm=comm, duration=busy[:, 0].copy(),
                          temporary_kv_bytes=self.model._temporary_kv(work))

    def _step_numbers(self, fixed) -> tuple:
        """(what `_rows` takes besides the contexts, each step's communication) for
        steps with these count pieces; (None, None) if they do not all decode (or
        their collectives read the contexts)."""
        safe_b, busy = fixed.decoders
        if safe_b is None or busy is not None or fixed.attn_comm is None:
            return None, None
        (compute_terms, comm_terms), full_layers = fixed.terms, self.model.full_layers
        comm = full_layers * fixed.attn_comm  # (added as `LayerStepModel._stage` adds it)
        for term in comm_terms:
            comm = comm + term
        # (float() of a number is exact, and refuses an array of several)
        numbers = (float(safe_b), *self.core, float(fixed.proj), full_layers,
                   np.array(compute_terms, dtype=np.float64), float(fixed.extra), float(comm),
                   float(fixed.cpu), float(fixed.launch), self.gap, self.async_scheduling)
        return numbers, comm


@njit(cache=True)
def _rows(context, batch, heads, kv_heads, head_dim, kv_bytes, fp8_factor, hbm_rate, sms,
          unit_s, launch_s, proj, full_layers, terms, extra, comm, cpu, launch, gap,
          async_scheduling):
    """(compute, busy) of each step, (k, 1): `context` the summed context of the
    rank's `batch` decoding requests in each step; the rest as the numpy path has it."""
    k = len(context)
    compute = np.empty((k, 1))
    busy = np.empty((k, 1))
    for i in range(k):
        ctx = np.maximum(context[i] / batch, 1.0)  # the mean context (`decode_core`)
        core = decode_seconds(batch, ctx, heads, kv_heads, head_dim, kv_bytes, fp8_factor,
                              hbm_rate, sms, unit_s, launch_s)
        c = full_layers * (proj + core)
        for term in terms:
            c = c + term
        c = c + extra
        compute[i, 0] = c
        busy[i, 0] = overlapped_step_s(c + comm, cpu, launch, gap, async_scheduling)
    return compute, busy
