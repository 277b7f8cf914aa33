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

import numpy as np
import pandas as pd

from labkit.engine.layouts import dcp_shard_tokens
from labkit.widgets.base import EngineView
from labkit.widgets.gpu_kv import gpu_kv, query_chunks, temporary_layers, temporary_tokens
from labkit.widgets.placement_cells import CATEGORIES, colorscale, grid
from labkit.widgets.placement_model import KVPlacementModel

COLUMNS = ["gpu", "dp_rank", "request_id", "start", "end", "interleave", "shards", "shard",
           "layers", "heads", "kind", "source"]
COLORS = {"computed": "#4C78A8", "cached": "#54A24B", "forked": "#B279A2",
          "loaded": "#E45756", "transferred": "#F58518", "temporary": "#D4A017"}
NAMES = {"computed": "computed here", "cached": "prefix-cache hit",
         "forked": "forked from its parent", "loaded": "loaded from an offload tier",
         "transferred": "transferred (P/D, another rank)",
         "temporary": "temporary: gathered while a layer runs"}
TEMPORARY_BAND = 0.45  # height of a temporary band, relative to a GPU's band


class KVPlacementView(EngineView):
    def __init__(self, engine, request_id: str | None = None, max_cells: int = 480) -> None:
        """`request_id`: draw that request only; `max_cells`: columns of the grid (token
        positions are aggregated into cells of a power-of-two number of tokens)."""
        self.request_id = request_id
        self.max_cells = max_cells
        self.spec = engine.placement
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
          attention layers among the layers have KV);
        - `kind`: "persistent" (kept in its blocks) or "temporary" (gathered or
          received only while a layer of that step runs, one layer at a time);
        - `source`: computed | cached | forked | loaded | transferred.
        """
        seq, state = self.model.state_at(step)
        rows = []
        for rid, kv in self._requests(state, seq):
            current = kv.step is not None and kv.step[0] == seq
            temp = temporary_tokens(self.spec, *kv.step[1:]) if current else 0
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
        seq, state = self.model.state_at(step)
        rows = []
        for rid, kv in self._requests(state, seq):
            if kv.step is None or kv.step[0] != seq or not kv.step[2]:
                continue
            for g in self._replica(kv.rank):
                chunks = query_chunks(kv.step[1], kv.step[2], self.spec.layout.pcp, g.pcp_index)
                rows += [(g.gpu, g.dp_rank, rid, a, b) for a, b in chunks]
        frame = pd.DataFrame(rows, columns=["gpu", "dp_rank", "request_id", "start", "end"])
        return frame.sort_values("gpu", kind="stable", ignore_index=True)

    def _requests(self, state, seq: int) -> list:
        """The requests drawn at step seq, by DP rank, then in order of arrival."""
        live = [(rid, kv) for rid, kv in state.items()
                if (self.request_id is None or rid == self.request_id)
                and (kv.held > 0 or (kv.step is not None and kv.step[0] == seq))]
        return sorted(live, key=lambda item: item[1].rank)

    def _replica(self, rank: int) -> list:
        return [g for g in self.gpus if g.dp_rank == rank]

    # --------------------------------------------------------------- figure
    def figure_data(self, upto_step=None) -> dict:
        seq, state = self.model.state_at(upto_step)
        frame, queries = self.placement(seq), self.queries(seq)
        order = [rid for rid, _ in self._requests(state, seq)]
        bands, edges, ticks = self._bands()
        cells = grid(frame, order, bands, len(edges) - 1, self.max_cells)
        return {"step": seq, "placement": frame, "queries": queries, "bands": bands,
                "y_edges": edges, "ticks": ticks, "held_tokens": held_tokens(frame), **cells}

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

    def make_figure(self):
        import plotly.graph_objects as go

        n = len(self.gpus)
        per_gpu = max(12, min(34, 640 // n))
        fig = go.FigureWidget(layout=dict(
            autosize=True, height=190 + per_gpu * n, margin=dict(l=10, r=10, t=80, b=120),
            plot_bgcolor="white",
            legend=dict(orientation="h", yref="container", y=0, yanchor="bottom", x=0),
            xaxis=dict(title="token position, requests side by side", showgrid=False,
                       zeroline=False),
            yaxis=dict(title="GPU", autorange="reversed", showgrid=False, zeroline=False,
                       automargin=True)))
        fig.add_heatmap(z=[[]], colorscale=colorscale(COLORS), zmin=0, zmax=len(CATEGORIES),
                        showscale=False, hoverinfo="skip")
        fig.add_scatter(x=[], y=[], mode="lines+markers", name="queries computed this step",
                        line=dict(color="black", width=2), marker=dict(size=4, color="black"),
                        hoverinfo="skip")
        fig.add_scatter(x=[], y=[], mode="lines", showlegend=False, hoverinfo="skip",
                        line=dict(color="#888", width=1, dash="dot"))
        for name in CATEGORIES:  # legend swatches
            fig.add_scatter(x=[None], y=[None], mode="markers", name=NAMES[name],
                            marker=dict(symbol="square", size=12, color=COLORS[name]))
        return fig

    def draw(self, data: dict) -> None:
        fig, n = self.figure, data["cell_tokens"]
        heat, queries, separators = fig.data[0], fig.data[1], fig.data[2]
        heat.z = np.round(data["z"], 3) if data["z"].size else [[]]
        heat.x, heat.y = data["x_edges"], data["y_edges"]
        x_of = {r: data["offsets"][r] * n for r in data["requests"]}
        qx, qy = [], []
        for row in data["queries"].itertuples(index=False):
            if row.request_id in x_of:
                y = data["y_edges"][data["bands"][(row.gpu, "persistent")]] + 0.5
                qx += [x_of[row.request_id] + row.start, x_of[row.request_id] + row.end, None]
                qy += [y, y, None]
        queries.x, queries.y = qx, qy
        top, bottom = data["y_edges"][0], data["y_edges"][-1]
        sx, sy = [], []
        for r in data["requests"][1:]:
            sx += [x_of[r], x_of[r], None]
            sy += [top, bottom, None]
        separators.x, separators.y = sx, sy
        fig.layout.yaxis.tickvals = [t for t, _ in data["ticks"]]
        held = data["held_tokens"]
        fig.layout.yaxis.ticktext = [f"{label} · {held.get(g.gpu, 0):,} tok"
                                     for (_, label), g in zip(data["ticks"], self.gpus)]
        fig.layout.annotations = self._request_labels(data, x_of)
        tokens = sum(data["lengths"].values())
        fig.layout.title = dict(x=0, text=(
            f"KV placement · {self.name} · {len(self.gpus)} GPUs · after step {data['step']}: "
            f"{len(data['requests'])} request(s), {tokens:,} tokens<br><sup>1 cell = {n:,} "
            f"token(s); pale = the GPU holds a share of the cell's tokens (a DCP shard)</sup>"))
        fig.layout.xaxis.title = (f"token position, requests side by side "
                                  f"(1 cell = {n:,} tokens)")

    @staticmethod
    def _request_labels(data: dict, x_of: dict) -> list:
        """Request ids above their columns (every k-th when there are many)."""
        requests = data["requests"]
        every = max(1, -(-len(requests) // 12))
        n = data["cell_tokens"]
        return [dict(x=x_of[r] + data["request_cells"][r] * n / 2, y=1.0, yref="paper",
                     yanchor="bottom", showarrow=False, font=dict(size=10),
                     text=f"{r} ({data['lengths'][r]:,})")
                for r in requests[::every]]


def held_tokens(frame: pd.DataFrame) -> dict[int, int]:
    """Positions of KV each GPU keeps (persistent rows), over all its requests."""
    rows = frame[frame["kind"] == "persistent"]
    if rows.empty:
        return {}
    args = [rows[c].to_numpy(np.int64) for c in ("shards", "interleave", "shard")]
    counts = dcp_shard_tokens(rows["end"].to_numpy(np.int64), *args) - \
        dcp_shard_tokens(rows["start"].to_numpy(np.int64), *args)
    return pd.Series(counts, index=rows["gpu"]).groupby(level=0).sum().to_dict()
