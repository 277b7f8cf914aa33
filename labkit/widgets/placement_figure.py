"""The placement view's figure: one heatmap of GPU bands x token cells, and marks.

`build` makes an empty figure (a live `FigureWidget` for the view, a plain `Figure` for
a static copy); `draw` fills it from the view's `figure_data` — the grid of
`placement_cells.py`, the queries of the step, request separators and labels, GPU labels
with the tokens each keeps. The figure's width follows its container (autosize); its
height follows the number of GPUs.
"""

from __future__ import annotations

import numpy as np

from labkit.widgets.placement_cells import CATEGORIES, colorscale

COLORS = {"computed": "#4C78A8", "cached": "#54A24B", "forked": "#B279A2",
          "loaded": "#E45756", "transferred": "#F58518", "temporary": "#D4A017"}
NAMES = {"computed": "computed here", "cached": "prefix-cache hit",
         "forked": "forked from its parent", "loaded": "loaded from an offload tier",
         "transferred": "transferred (P/D, another rank)",
         "temporary": "temporary: gathered while a layer runs"}


def build(figure_class, num_gpus: int):
    per_gpu = max(12, min(34, 640 // num_gpus))  # pixels per GPU band
    fig = figure_class(layout=dict(
        autosize=True, height=190 + per_gpu * num_gpus, margin=dict(l=10, r=10, t=96, b=120),
        plot_bgcolor="white",
        legend=dict(orientation="h", yref="container", y=0, yanchor="bottom", x=0),
        xaxis=dict(title="token position, requests side by side", showgrid=False,
                   zeroline=False),
        yaxis=dict(title="GPU", autorange="reversed", showgrid=False, zeroline=False,
                   automargin=True)))
    fig.add_heatmap(z=[[]], colorscale=colorscale(COLORS), zmin=0, zmax=len(CATEGORIES) + 1,
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


def draw(fig, data: dict, gpus: list, name: str) -> None:
    """Fill `fig` from `data` (a view's `figure_data`)."""
    n = data["cell_tokens"]
    heat, queries, separators = fig.data[0], fig.data[1], fig.data[2]
    heat.z = data["z"].astype(np.float32) if data["z"].size else [[]]
    heat.x, heat.y = data["x_edges"], data["y_edges"]
    # position p of request r is drawn at x_of[r] + p (cells start at the window's a)
    x_of = {r: data["offsets"][r] * n for r in data["requests"]}
    a, b = data["window"]
    queries.x, queries.y = _query_marks(data, x_of)
    top, bottom = data["y_edges"][0], data["y_edges"][-1]
    starts = [x_of[r] + a for r in data["requests"][1:]]
    separators.x = [x for s in starts for x in (s, s, None)]
    separators.y = [y for _ in starts for y in (top, bottom, None)]
    held = data["held_tokens"]
    fig.layout.yaxis.tickvals = [t for t, _ in data["ticks"]]
    fig.layout.yaxis.ticktext = [f"{label} · {held.get(g.gpu, 0):,} tok"
                                 for (_, label), g in zip(data["ticks"], gpus)]
    fig.layout.annotations = _request_labels(data, x_of)
    tokens = sum(data["lengths"].values())
    cell = f"1 cell = {n:,} token{'s' if n > 1 else ''}"
    fig.layout.title = dict(x=0.01, text=(
        f"KV placement · {name} · {len(gpus)} GPUs · after step {data['step']}: "
        f"{len(data['requests'])} request(s), {tokens:,} tokens<br><sup>{cell}; full colour = "
        f"the GPU keeps all of those tokens' KV, pale = a share (a DCP shard, a slice of the KV "
        f"heads, a PP stage's layers)</sup>"))
    parts = ["token position"]
    if (a, b) != (0, None):
        parts.append(f"positions {a:,} to {'the end' if b is None else f'{b:,}'}")
    if len(data["requests"]) > 1:
        parts.append("requests side by side")
    fig.layout.xaxis.title = f"{', '.join(parts)} ({cell})"


def _query_marks(data: dict, x_of: dict) -> tuple[list, list]:
    """Line segments over the positions each GPU computes queries for this step."""
    xs, ys = [], []
    a, b = data["window"]
    for row in data["queries"].itertuples(index=False):
        start, end = max(row.start, a), min(row.end, b if b is not None else row.end)
        if row.request_id in x_of and end > start:
            y = data["y_edges"][data["bands"][(row.gpu, "persistent")]] + 0.5
            xs += [x_of[row.request_id] + start, x_of[row.request_id] + end, None]
            ys += [y, y, None]
    return xs, ys


def _request_labels(data: dict, x_of: dict) -> list:
    """Request ids (and lengths) above their columns, on two staggered lines; a request
    narrower than 1/25 of the width goes unlabelled (see `placement()`)."""
    n, total = data["cell_tokens"], max(1, len(data["x_edges"]) - 1)
    wide = [r for r in data["requests"] if data["request_cells"][r] * 25 >= total]
    a = data["window"][0]
    return [dict(x=x_of[r] + a + data["request_cells"][r] * n / 2, y=1.0, yref="paper",
                 yanchor="bottom", yshift=14 * (i % 2), showarrow=False, font=dict(size=10),
                 text=f"{r} ({data['lengths'][r]:,})")
            for i, r in enumerate(wide)]

