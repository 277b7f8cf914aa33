"""Placement rows -> a GPUs x token-cells grid a figure can draw at any scale.

A 1M-token context is a million columns; a screen shows about a thousand. So the
requests are laid side by side and their positions aggregated into cells of N tokens
(N a power of two, chosen so all cells fit in `max_cells`; a request shorter than a
cell still gets one, so nothing disappears). A window [a, b) of positions zooms in: the
same cells over fewer positions, down to one token per cell. Each GPU gets a band (and, for layouts
that gather KV while a layer runs, a thinner band under it for that temporary KV).
A cell's value tells two things at once:

- *what* the GPU holds there: the source most of its held positions came from
  (computed, cached, forked, loaded, transferred), or "temporary" in a temporary band;
- *how much*: the share of the KV of the cell's positions the GPU keeps — the positions
  it holds (all of them under TP, one in `dcp` under DCP, counted exactly with the DCP
  formula) times the share of KV heads and layers it holds them for (MLA's latent under
  TP: all; GQA under TP8: one head in eight; a PP stage: its layers). So a full copy is
  full colour and a layout's copies can be counted by eye. A temporary band shows the
  share of positions only (it holds them one layer at a time).

Encoded as `1 + category + 0.05 + 0.9 * sqrt(share)` (0.5 for an empty cell), so one heatmap
with a banded colour scale draws both (pale = a small share; empty = white) from a
plain float array — no NaN, which JSON (a live widget's messages) cannot carry.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from labkit.engine.layouts import dcp_shard_tokens
from labkit.widgets.placement_model import SOURCES

CATEGORIES = (*SOURCES, "temporary")
TEMPORARY = len(SOURCES)


def cell_tokens(total: int, max_cells: int) -> int:
    """The smallest power of two N with ceil(total / N) <= max_cells."""
    n = 1
    while -(-total // n) > max_cells:
        n *= 2
    return n


def grid(frame: pd.DataFrame, order: list[str], bands: dict[tuple[int, str], int],
         num_bands: int, max_cells: int, window: tuple[int, int | None] = (0, None),
         kv_fraction=lambda row: 1.0) -> dict:
    """Cells of the requests in `order` (those with rows), per band (`bands` maps
    (gpu, kind) to a band index), over positions [a, b) of each request (`window`;
    b None: to its end). Cell c of a request covers positions a + c*N .. a + (c+1)*N.
    `kv_fraction(row)`: the share of a position's KV (heads, layers) a persistent row
    holds."""
    a, b = window
    ends = frame.groupby("request_id")["end"].max().to_dict() if len(frame) else {}
    lengths = {r: min(e, b if b is not None else e) - a for r, e in ends.items()}
    order = [r for r in order if lengths.get(r, 0) > 0]
    n = cell_tokens(sum(lengths[r] for r in order), max_cells)
    cells = np.array([-(-lengths[r] // n) for r in order], dtype=np.int64)
    offset = dict(zip(order, np.concatenate([[0], np.cumsum(cells)[:-1]]).tolist()))
    total_cells = int(cells.sum())
    counts = np.zeros((len(CATEGORIES), num_bands, total_cells))
    # temporary KV of several layers (KVPP) covers the same positions once
    rows = frame.drop_duplicates(["gpu", "request_id", "start", "end", "kind"])
    for row in rows.itertuples(index=False):
        if row.request_id not in offset:
            continue
        start, end = max(row.start, a), min(row.end, a + lengths[row.request_id])
        if end <= start:
            continue
        c0, c1 = (start - a) // n, -(-(end - a) // n)
        edges = np.clip(a + np.arange(c0, c1 + 1) * n, start, end)
        held = np.diff(dcp_shard_tokens(edges, row.shards, row.interleave, row.shard))
        if row.kind == "temporary":
            category = TEMPORARY
        else:
            category, held = SOURCES.index(row.source), held * kv_fraction(row)
        first = offset[row.request_id] + c0
        counts[category, bands[(row.gpu, row.kind)], first:first + len(held)] += held
    size = np.concatenate([np.minimum(n, lengths[r] - n * np.arange(c))
                           for r, c in zip(order, cells)]) if order else np.zeros(0)
    held = counts.sum(axis=0)
    share = np.divide(held, size, out=np.zeros_like(held), where=size > 0)
    # the square root spreads small shares apart (1/16 and 1/8 must look different)
    z = np.where(held > 0, 1.05 + counts.argmax(axis=0) + 0.9 * np.sqrt(np.minimum(share, 1.0)),
                 0.5)
    return {"cell_tokens": n, "requests": order, "window": (a, b),
            "request_cells": dict(zip(order, cells.tolist())), "offsets": offset,
            "lengths": {r: int(lengths[r]) for r in order}, "z": z, "share": share,
            "x_edges": a + np.arange(total_cells + 1) * n}


def colorscale(colors: dict[str, str]) -> list:
    """Banded: [0, 1) of z is empty (white); category i spans [i+1, i+2), from a pale
    tint of its colour to the colour itself (use zmin=0, zmax=len(CATEGORIES) + 1)."""
    k = len(CATEGORIES) + 1
    scale = [[0.0, "#FFFFFF"], [1 / k, "#FFFFFF"]]
    for i, name in enumerate(CATEGORIES, start=1):
        scale += [[i / k, _tint(colors[name])], [(i + 1) / k, colors[name]]]
    return scale


def _tint(color: str, white: float = 0.82) -> str:
    r, g, b = (int(color[i:i + 2], 16) for i in (1, 3, 5))
    r, g, b = (round(c + (255 - c) * white) for c in (r, g, b))
    return f"#{r:02X}{g:02X}{b:02X}"
