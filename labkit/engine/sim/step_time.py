"""`CostModel.step_time`: the step model for one hand-written batch.

The engine costs its steps through `LayerStepModel.step_timing` on a `StepWork`; this
function builds that same `StepWork` from a list of {"new_tokens", "context"} entries,
and the step model from the same knobs (`**knobs`: any engine knob, e.g.
`async_scheduling=False`, `cudagraph_mode="NONE"`, `enable_eplb=True`), so a notebook
question ("how long is one step of this batch under pcp8xdcp8?") and the
engine's simulation can never disagree.
"""

from __future__ import annotations

from labkit.engine.capacity import placement_for
from labkit.engine.scheduler import RankBatch
from labkit.engine.sim.layer_model import LayerStepModel
from labkit.engine.step_work import StepWork
from labkit.errors import ConfigError
from labkit.specs import EngineConfig, Layout, get_model


class _Entry:
    """Just enough of a request for a RankBatch."""

    __slots__ = ("num_computed_tokens",)

    def __init__(self, context: int) -> None:
        self.num_computed_tokens = context


def step_time(cm, model, layout, batch, *, kv_dtype="bf16", num_speculative_tokens=0,
              dcp_kv_cache_interleave_size=1, lockstep=None, **knobs) -> dict:
    model, layout = get_model(model), Layout.parse(layout)
    config = EngineConfig.from_knobs(kv_cache_dtype=kv_dtype,
                                     num_speculative_tokens=num_speculative_tokens,
                                     dcp_kv_cache_interleave_size=dcp_kv_cache_interleave_size,
                                     **knobs)
    placement = placement_for(model, layout, config)
    per_rank = batch if batch and isinstance(batch[0], (list, tuple)) else [batch]
    if len(per_rank) > layout.num_dp_ranks:
        raise ConfigError(f"{len(per_rank)} rank batches for layout {layout.text!r} with "
                          f"{layout.num_dp_ranks} DP rank(s)")
    width = 1 + num_speculative_tokens
    batches = []
    for r, entries in enumerate(per_rank):
        rb = RankBatch(r)
        for e in entries:
            n, ctx = int(e["new_tokens"]), int(e.get("context", 0))
            if n < 1 or ctx < 0:
                raise ConfigError(f"batch entry {e}: new_tokens must be >= 1, context >= 0")
            decode = e.get("decode", n == width and ctx > 0)
            rb.add(_Entry(ctx), n, bool(decode))
        batches.append(rb)
    lockstep = layout.lockstep if lockstep is None else lockstep
    timing = LayerStepModel.from_config(placement, cm, config).step_timing(
        StepWork.from_batches(batches), lockstep)
    busy, compute, comm = timing.busy[0], timing.compute[0], timing.comm[0]
    slowest = int(busy.argmax())
    ranks = [{"seconds": float(busy[r]), "compute_s": float(compute[r]),
              "comm_s": float(comm[r]), "stall_s": float(timing.duration[0] - busy[r])}
             for r in range(len(batches))]
    return {"seconds": float(timing.duration[0]), "compute_s": float(compute[slowest]),
            "comm_s": float(comm[slowest]), "per_rank": ranks}
