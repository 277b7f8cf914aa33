"""Placement rows -> a GPUs x token-cells grid a figure can draw at any scale.

A 1M-token context is a million columns; a screen shows about a thousand. So the
requests are laid side by side and their positions aggregated into cells of N tokens
(N a power of two, chosen so all cells fit in `max_cells`; a request shorter than a
cell still gets one, so nothing disappears). Each GPU gets a band (and, for layouts
that gather KV while a layer runs, a thinner band under it for that temporary KV).
A cell's value tells two things at once:

- *what* the GPU holds there: the source most of its held positions came from
  (computed, cached, forked, loaded, transferred), or "temporary" in a temporary band;
- *how much*: the share of the cell's positions the GPU holds — all of them under TP,
  one in `dcp` under DCP — counted exactly with the DCP formula.

Encoded as `category + 0.05 + 0.9 * share`, so one heatmap with a banded colour scale
draws both (pale = a small share).
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
         num_bands: int, max_cells: int) -> dict:
    """Cells of the requests in `order` (those with rows), per band (`bands` maps
    (gpu, kind) to a band index)."""
    lengths = frame.groupby("request_id")["end"].max().to_dict() if len(frame) else {}
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
        c0, c1 = row.start // n, -(-row.end // n)
        edges = np.clip(np.arange(c0, c1 + 1) * n, row.start, row.end)
        held = np.diff(dcp_shard_tokens(edges, row.shards, row.interleave, row.shard))
        category = TEMPORARY if row.kind == "temporary" else SOURCES.index(row.source)
        first = offset[row.request_id] + c0
        counts[category, bands[(row.gpu, row.kind)], first:first + len(held)] += held
    size = np.concatenate([np.minimum(n, lengths[r] - n * np.arange(c))
                           for r, c in zip(order, cells)]) if order else np.zeros(0)
    held = counts.sum(axis=0)
    share = np.divide(held, size, out=np.zeros_like(held), where=size > 0)
    z = np.where(held > 0, counts.argmax(axis=0) + 0.05 + 0.9 * np.minimum(share, 1.0), np.nan)
    return {"cell_tokens": n, "requests": order,
            "request_cells": dict(zip(order, cells.tolist())), "offsets": offset,
            "lengths": {r: int(lengths[r]) for r in order}, "z": z, "share": share,
            "x_edges": np.arange(total_cells + 1) * n}


def colorscale(colors: dict[str, str]) -> list:
    """Banded: category i spans [i, i+1) of z, from a pale tint of its colour to it."""
    k = len(CATEGORIES)
    scale = []
    for i, name in enumerate(CATEGORIES):
        scale += [[i / k, _tint(colors[name])], [(i + 1) / k, colors[name]]]
    return scale


def _tint(color: str, white: float = 0.82) -> str:
    r, g, b = (int(color[i:i + 2], 16) for i in (1, 3, 5))
    r, g, b = (round(c + (255 - c) * white) for c in (r, g, b))
    return f"#{r:02X}{g:02X}{b:02X}"
