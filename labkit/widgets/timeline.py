"""Compare's timeline: several layouts' runs as rows of one figure on one time axis.

Rows, top to bottom: each layout's lockstep heatmap (DP ranks x time; colour = share
of step time stalled, one colour bar for all), then KV per GPU over time and the
prefix-cache hit rate over time with a line per layout. The rows share their x axis,
so zooming one zooms all: a stall in one layout sits right above the other layouts'
same moment.
"""

from __future__ import annotations

import numpy as np

GIB = 1 << 30
PALETTE = ["#4C78A8", "#F58518", "#54A24B", "#B279A2", "#E45756", "#72B7B2", "#9D755D"]


def kv_over_time(frame, edges: np.ndarray) -> dict:
    """KV per GPU at each bin edge (held since the last step that ended before it):
    the mean and the max over DP ranks, in bytes."""
    per_rank = []
    for _, rows in frame.groupby("dp_rank"):
        ends = rows["end_s"].to_numpy()
        used = (rows["persistent_kv_bytes"] + rows["temporary_kv_bytes"]).to_numpy()
        at = np.searchsorted(ends, edges, side="right") - 1
        per_rank.append(np.where(at >= 0, used[np.maximum(at, 0)], 0.0))
    if not per_rank:
        return {"t": edges.tolist(), "mean": [0.0] * len(edges), "max": [0.0] * len(edges),
                "capacity": 0.0}
    stack = np.vstack(per_rank)
    return {"t": edges.tolist(), "mean": stack.mean(axis=0).tolist(),
            "max": stack.max(axis=0).tolist(),
            "capacity": float(frame["capacity_bytes"].max())}


def timeline_figure(layouts: list[str], ranks: dict[str, list[int]]):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    heights = [max(len(ranks[k]), 2) for k in layouts] + [5, 4]
    fig = go.Figure(make_subplots(
        rows=len(layouts) + 2, cols=1, shared_xaxes=True, vertical_spacing=0.035,
        row_heights=[h / sum(heights) for h in heights],
        subplot_titles=[f"{k}: lockstep (DP ranks)" for k in layouts]
        + ["KV per GPU (GiB): mean over DP ranks (solid), max (dotted)",
           "prefix-cache hit rate so far (%)"]))
    for i, layout in enumerate(layouts):
        fig.add_heatmap(z=[], x=[], y=[], coloraxis="coloraxis", row=i + 1, col=1,
                        name=layout,
                        hovertemplate=f"{layout}, %{{y}}, t = %{{x:.2f}} s: "
                                      f"%{{z:.0f}} % stalled<extra></extra>")
        fig.update_yaxes(autorange="reversed", row=i + 1, col=1)
    kv_row, hit_row = len(layouts) + 1, len(layouts) + 2
    for i, layout in enumerate(layouts):
        color = PALETTE[i % len(PALETTE)]
        fig.add_scatter(x=[], y=[], mode="lines", name=layout, legendgroup=layout,
                        line=dict(color=color), row=kv_row, col=1)
        fig.add_scatter(x=[], y=[], mode="lines", name=f"{layout} (max)", legendgroup=layout,
                        line=dict(color=color, dash="dot"), showlegend=False,
                        row=kv_row, col=1)
        fig.add_scatter(x=[], y=[], mode="lines", name=layout, legendgroup=layout,
                        line=dict(color=color), showlegend=False, row=hit_row, col=1)
    fig.update_yaxes(title_text="GiB", rangemode="tozero", row=kv_row, col=1)
    fig.update_yaxes(title_text="%", range=[0, 100], row=hit_row, col=1)
    fig.update_xaxes(title_text="time (s)", row=hit_row, col=1)
    fig.update_layout(
        autosize=True, height=160 + 26 * sum(heights), template="plotly_white",
        plot_bgcolor="#e5e5e5", margin=dict(l=70, r=20, t=60, b=50),
        title="Layouts side by side on one time axis",
        coloraxis=dict(colorscale="Reds", cmin=0, cmax=100,
                       colorbar=dict(title=dict(text="stalled, % of step time",
                                                side="right"), thickness=14,
                                     ticksuffix=" %", len=0.5, y=1.0, yanchor="top")),
        legend=dict(orientation="h", yanchor="bottom", y=1.02, xanchor="right", x=1.0))
    return fig


def draw_timeline(fig, data: dict) -> None:
    """Fill the figure from `Compare.timeline_data()`."""
    layouts = list(data)
    with fig.batch_update():
        for i, layout in enumerate(layouts):
            grid = data[layout]["lockstep"]
            heat = fig.data[i]
            edges = grid["edges"]
            heat.x = ((edges[:-1] + edges[1:]) / 2).tolist()
            heat.y = [f"rank {r}" for r in grid["ranks"]]
            heat.z = np.where(np.isnan(grid["stall_share"]), None,
                              grid["stall_share"]).tolist()
        lines = fig.data[len(layouts):]
        for i, layout in enumerate(layouts):
            kv = data[layout]["kv"]
            mean, top, hit = lines[3 * i: 3 * i + 3]
            mean.x = top.x = kv["t"]
            mean.y = [v / GIB for v in kv["mean"]]
            top.y = [v / GIB for v in kv["max"]]
            mean.name = f"{layout} (capacity {kv['capacity'] / GIB:.0f} GiB/GPU)"
            hit.x = data[layout]["hit_t"]
            hit.y = [100 * r for r in data[layout]["hit_rate"]]
        end = max(float(data[k]["lockstep"]["edges"][-1]) for k in layouts)
        fig.update_xaxes(range=[0, end])
