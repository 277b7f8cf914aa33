"""KVPlacementView: which GPU holds which tokens' KV, for the requests in flight.

One band per GPU, the requests side by side along the x axis (token positions). A
cell is coloured where the GPU holds KV of those positions, by where that KV came from
(computed here, a prefix-cache hit, forked from a parent, loaded from an offload tier,
transferred from another rank or a P/D prefill group), pale where the GPU holds only a
share of them (a DCP shard). Under each GPU of a layout that gathers KV while a layer
runs, a thin band shows that temporary copy during the step shown; black marks are the
positions whose queries the GPU computes in that step (PCP: its two paired chunks).

Toggle a layout and the picture changes as the placement does: TP8 on an MLA model
fills every band (the latent is replicated), TP8xDCP8 makes all eight pale (one token
in eight each), DEP8 puts each request on its own rank's band only.

The same data is a DataFrame: `view.placement(step)` (see `placement`) and
`view.queries(step)`. Which GPU holds what follows `gpu_kv.py`; the requests' tokens
and sources come from events (`placement_model.py`).
"""

from __future__ import annotations

import pandas as pd

from labkit.widgets import placement_figure
from labkit.widgets.base import EngineView
from labkit.widgets.gpu_kv import (
    gpu_kv, kv_fraction, query_chunks, temporary_layers, temporary_tokens,
)
from labkit.widgets.placement_cells import grid
from labkit.widgets.placement_model import KVPlacementModel
from labkit.widgets.placement_summary import held_tokens, per_gpu

COLUMNS = ["gpu", "dp_rank", "request_id", "start", "end", "interleave", "shards", "shard",
           "layers", "heads", "kind", "source"]
TEMPORARY_BAND = 0.45  # height of a temporary band, relative to a GPU's band


class KVPlacementView(EngineView):
    def __init__(self, engine, request_id: str | None = None, max_cells: int = 480) -> None:
        """`request_id`: draw that request only; `max_cells`: columns of the grid (token
        positions are aggregated into cells of a power-of-two number of tokens)."""
        if not hasattr(engine, "placement"):  # a PDEngine: its groups are engines
            raise TypeError("KVPlacementView draws one engine's GPUs; for P/D pass one "
                            "group, e.g. pd.decode[0] (its prompts show as transferred)")
        self.request_id = request_id
        self.max_cells = max_cells
        self.window: tuple[int, int | None] = (0, None)  # positions drawn (see zoom)
        self.focus: str | None = None  # the one request drawn (see zoom)
        self.spec = engine.placement
        self.model_spec = engine.model
        self.gpus = gpu_kv(engine.placement)
        self.interleave = engine.config.dcp_kv_cache_interleave_size
        self.name = f"{engine.model.name} {engine.layout.text}"
        lay = engine.layout
        self.has_temporary = (lay.kvpp > 1 or (lay.pcp > 1 and lay.dcp > 1)
                              or engine.placement.gathers_prefix_for_prefill())
        super().__init__(KVPlacementModel(engine))

    # ------------------------------------------------------------------ data
    def placement(self, step: int | None = None) -> pd.DataFrame:
        """Who holds what after `step` completed steps (None: now), one row per GPU,
        request, kind and contiguous run of one source:

        - the GPU holds the positions p in [start, end) with
          `(p // interleave) % shards == shard` (shards = 1: all of them);
        - of the decoder layers in `layers` and the KV heads in `heads` (`Indices`,
          printed `0-60` or `3-59 every 8`; `5 in row.layers` and `row.layers.range`
          work as with a range; MLA's latent is head 0; on hybrid models only the
          attention layers among the layers have KV, and sliding-window layers only
          the window's);
        - `kind`: "persistent" (kept in its blocks) or "temporary" (gathered or
          received only while a layer of that step runs, one layer at a time);
        - `source`: computed | cached | forked | loaded | transferred.
        """
        return self._placement(*self.model.state_at(step))

    def _placement(self, seq: int, state) -> pd.DataFrame:
        rows = []
        for rid, kv in self._requests(state, seq):
            step = kv.step_at(seq)
            temp = temporary_tokens(self.spec, step.context, step.num_new, step.decode) \
                if step else 0
            for g in self._replica(kv.rank):
                every = self.interleave if g.shards > 1 else 1
                rows += [(g.gpu, g.dp_rank, rid, a, b, every, g.shards, g.shard, g.layers,
                          g.heads, "persistent", source) for a, b, source in kv.sources(kv.held)]
                for layers in temporary_layers(self.spec, g) if temp else ():
                    rows += [(g.gpu, g.dp_rank, rid, a, b, 1, 1, 0, layers, g.heads,
                              "temporary", source) for a, b, source in kv.sources(temp)]
        frame = pd.DataFrame(rows, columns=COLUMNS)
        return frame.sort_values("gpu", kind="stable", ignore_index=True)

    def queries(self, step: int | None = None) -> pd.DataFrame:
        """Positions [start, end) whose queries each GPU computed in step `step` (PCP:
        its two paired chunks of each request's new tokens; otherwise all of them)."""
        return self._queries(*self.model.state_at(step))

    def _queries(self, seq: int, state) -> pd.DataFrame:
        rows = []
        for rid, kv in self._requests(state, seq):
            step = kv.step_at(seq)
            if not step or not step.num_new:
                continue
            for g in self._replica(kv.rank):
                chunks = query_chunks(step.context, step.num_new, self.spec.layout.pcp,
                                      g.pcp_index)
                rows += [(g.gpu, g.dp_rank, rid, a, b) for a, b in chunks]
        frame = pd.DataFrame(rows, columns=["gpu", "dp_rank", "request_id", "start", "end"])
        return frame.sort_values("gpu", kind="stable", ignore_index=True)

    def per_gpu(self, step: int | None = None) -> pd.DataFrame:
        """One row per GPU after `step` steps: what it holds, its requests, the tokens of
        KV it keeps (persistent) and gathers while a layer runs (temporary), and
        `kv_share`, the fraction of one full copy of its DP rank's KV it keeps (their sum
        over a replica is the layout's number of KV copies; `placement_summary.py`)."""
        return per_gpu(self.placement(step), self.gpus, self.model_spec)

    def _requests(self, state, seq: int) -> list:
        """The requests drawn at step seq, by DP rank, then in order of arrival."""
        live = [(rid, kv) for rid, kv in state.items()
                if (self.request_id is None or rid == self.request_id)
                and (kv.held > 0 or kv.step_at(seq))]
        return sorted(live, key=lambda item: item[1].rank)

    def _replica(self, rank: int) -> list:
        return [g for g in self.gpus if g.dp_rank == rank]

    # --------------------------------------------------------------- figure
    def figure_data(self, upto_step=None) -> dict:
        seq, state = self.model.state_at(upto_step)
        frame, queries = self._placement(seq, state), self._queries(seq, state)
        order = [rid for rid, _ in self._requests(state, seq)
                 if self.focus is None or rid == self.focus]
        if self.focus is not None:
            frame = frame[frame.request_id == self.focus]
            queries = queries[queries.request_id == self.focus]
        bands, edges, ticks = self._bands()
        cells = grid(frame, order, bands, len(edges) - 1, self.max_cells, self.window,
                     self._kv_fraction)
        return {"step": seq, "placement": frame, "queries": queries, "bands": bands,
                "y_edges": edges, "ticks": ticks, "held_tokens": held_tokens(frame), **cells}

    def _kv_fraction(self, row) -> float:
        return kv_fraction(self.model_spec, row.heads, row.layers)

    def _bands(self) -> tuple[dict, list[float], list[tuple[float, str]]]:
        """Band index of each (gpu, kind), the bands' y edges and the GPU ticks."""
        bands, edges, ticks = {}, [0.0], []
        for g in self.gpus:
            bands[(g.gpu, "persistent")] = len(edges) - 1
            ticks.append((edges[-1] + 0.5, g.label))
            edges.append(edges[-1] + 1.0)
            if self.has_temporary:
                bands[(g.gpu, "temporary")] = len(edges) - 1
                edges.append(edges[-1] + TEMPORARY_BAND)
        return bands, edges, ticks

    def zoom(self, start: int = 0, end: int | None = None,
             request_id: str | None = None) -> None:
        """Draw positions [start, end) of each request only (of `request_id` only, if
        given) — down to one token per cell, where a DCP shard's interleave shows. No
        arguments: everything again. `placement()` is not affected."""
        if start < 0 or (end is not None and end <= start):
            raise ValueError(f"zoom({start}, {end}): need 0 <= start < end")
        self.window, self.focus = (start, end), request_id
        self.redraw()

    def make_figure(self):
        import plotly.graph_objects as go

        return placement_figure.build(go.FigureWidget, len(self.gpus))

    def draw(self, data: dict) -> None:
        placement_figure.draw(self.figure, data, self.gpus, self.name)

    def static_figure(self, step: int | None = None):
        """A plain plotly `Figure` of the view after `step` steps (default: what it
        shows now), with compact typed arrays: to keep in a notebook, save with
        `write_html`, or put in a paper. No widget needed."""
        import plotly.graph_objects as go

        fig = placement_figure.build(go.Figure, len(self.gpus))
        data = self.figure_data(self.shown_step if step is None else step)
        placement_figure.draw(fig, data, self.gpus, self.name)
        return fig
