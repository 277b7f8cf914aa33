"""BlockTableView: the block tables of the requests on one DP rank, block by block.

A row per request, a column per logical block (`block_size` tokens); a cell is the
physical block holding that part of the request's KV, coloured by where it came from
and whether others use it too:

- *computed*: this request computed it;
- *prefix hit*: found in the prefix cache when the request was admitted;
- *shared*: referenced by more than one running request right now (ref count > 1);
- *forked*: inherited from the parent at a fork (a subagent's context);
- *copied*: the private copy a copy-on-write made of a shared, partly filled block;
- *from CPU* / *from disk*: loaded from the node's offload tiers (`KVLoaded`).

Nothing is cut off silently. A table wider than the plot is aggregated — each column
stands for k consecutive blocks, drawn in their most common state (hover: the count
of each), and the title says k; `view.zoom(first, last)` draws a range of blocks one
by one. More requests than `rows` are paged (`view.show_page`), and the title says
which page.

The model rebuilds the tables from block events alone (`CacheHit`, `Forked`,
`BlocksAllocated`, `CopyOnWrite`, `BlocksFreed`, `BlocksCached`, `BlocksEvicted`,
`KVLoaded`) — it never looks inside the KV manager — so comparing it with the
manager's own tables checks both. `model.frame()` is one row per (request, block).
"""

from __future__ import annotations

import math
from collections import Counter


from labkit.engine.events import (
    BlocksAllocated, BlocksCached, BlocksEvicted, BlocksFreed, CacheHit, CopyOnWrite, Forked,
    KVLoaded,
)
from labkit.widgets.base import EngineView, EventModel, empty_state, new_figure

STATES = {"empty": 0, "computed": 1, "prefix hit": 2, "shared": 3, "forked": 4, "copied": 5,
          "cpu": 6, "disk": 7}
LABELS = ["", "computed", "prefix hit", "shared", "forked", "copied (CoW)", "from CPU",
          "from disk"]
COLORS = ["#FFFFFF", "#9ECAE9", "#54A24B", "#F58518", "#B279A2", "#E45756", "#72B7B2",
          "#9D755D"]
END_OF_STEP = (BlocksCached, BlocksFreed)  # what happens when a step ends (base.py)


class BlockState:
    """The block tables of one rank, as block events describe them."""

    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}
        self.source: dict[str, dict[int, int]] = {}  # request -> block -> state it came as
        self.keyed: set[int] = set()

    def apply(self, event) -> None:
        if isinstance(event, CacheHit):
            self.tables[event.request_id] = event.blocks.tolist()
            self.source[event.request_id] = dict.fromkeys(event.blocks.tolist(),
                                                          STATES["prefix hit"])
        elif isinstance(event, Forked):
            self.tables[event.child_id] = event.blocks.tolist()
            self.source[event.child_id] = dict.fromkeys(event.blocks.tolist(), STATES["forked"])
        elif isinstance(event, BlocksAllocated):
            self.tables.setdefault(event.request_id, []).extend(event.blocks.tolist())
        elif isinstance(event, CopyOnWrite):
            table = self.tables[event.request_id]
            table[table.index(event.src_block)] = event.dst_block
            source = self.source.setdefault(event.request_id, {})
            source.pop(event.src_block, None)
            source[event.dst_block] = STATES["copied"]
        elif isinstance(event, KVLoaded):
            self.source.setdefault(event.request_id, {}).update(
                (b, STATES[tier]) for b, tier in zip(event.blocks.tolist(), event.block_tiers))
        elif isinstance(event, BlocksFreed):
            self.tables.pop(event.request_id, None)
            self.source.pop(event.request_id, None)
        elif isinstance(event, BlocksCached):
            self.keyed.update(event.blocks.tolist())
        elif isinstance(event, BlocksEvicted):
            self.keyed.difference_update(event.blocks.tolist())

    def ref_counts(self) -> Counter:
        return Counter(b for table in self.tables.values() for b in table)

    def cached_free(self) -> set[int]:
        """Blocks nobody references that still hold cached KV."""
        return self.keyed - set(self.ref_counts())

    def cell_state(self, request_id: str, block: int, refs: Counter) -> int:
        came_as = self.source.get(request_id, {}).get(block, STATES["computed"])
        if came_as in (STATES["copied"], STATES["forked"], STATES["cpu"], STATES["disk"]):
            return came_as
        return STATES["shared"] if refs[block] > 1 else came_as


class BlockTableModel(EventModel):
    kinds = (CacheHit, Forked, BlocksAllocated, CopyOnWrite, BlocksFreed, BlocksCached,
             BlocksEvicted, KVLoaded)

    def __init__(self, engine, rank: int = 0) -> None:
        self.rank = rank
        self.block_size = engine.block_size
        self.live = BlockState()
        self.log: list[tuple[float, int, bool, object]] = []  # (t, tag, end of step, event)
        self._replayed = (0, BlockState())  # (events applied, state): stepping forward is cheap
        super().__init__(engine)

    def on_event(self, event) -> None:
        if getattr(event, "rank", None) != self.rank:
            return
        self.live.apply(event)
        self.log.append((event.t, self.steps_done + 1, isinstance(event, END_OF_STEP), event))

    def state_at(self, upto_step: int | None = None) -> BlockState:
        """The tables as they were when step `upto_step` had just completed (read
        only: the returned state is kept to replay the next step from)."""
        if upto_step is None:
            return self.live
        stop = self.clock.cut(self.log, self.clock.last_step(self.rank, upto_step))
        done, state = self._replayed
        if stop < done:  # an earlier step: replay from the start
            done, state = 0, BlockState()
        for _, _, _, event in self.log[done:stop]:
            state.apply(event)
        self._replayed = (stop, state)
        return state

    def tables(self, upto_step: int | None = None) -> dict:
        """Every table on the rank (none left out): ids, blocks, per-block states and
        ref counts, and the rank's totals."""
        state = self.state_at(upto_step)
        refs = state.ref_counts()
        requests = list(state.tables)
        codes = [[state.cell_state(rid, b, refs) for b in state.tables[rid]] for rid in requests]
        counted = Counter(c for row in codes for c in row)
        return {"rank": self.rank, "requests": requests,
                "blocks": [list(state.tables[rid]) for rid in requests], "state": codes,
                "refs": [[refs[b] for b in state.tables[rid]] for rid in requests],
                "blocks_in_use": len(refs), "shared_blocks": sum(n > 1 for n in refs.values()),
                "cached_free_blocks": len(state.cached_free()),
                "cells_by_state": {LABELS[s]: counted[s] for s in range(1, len(LABELS))}}

    def frame(self, upto_step: int | None = None):
        """One row per (request, logical block): its physical block, refs, state."""
        import pandas as pd

        t = self.tables(upto_step)
        rows = [(rid, i, b, n, LABELS[s])
                for rid, blocks, refs, codes in zip(t["requests"], t["blocks"], t["refs"],
                                                    t["state"])
                for i, (b, n, s) in enumerate(zip(blocks, refs, codes))]
        return pd.DataFrame(rows, columns=["request_id", "logical_block", "physical_block",
                                           "ref_count", "state"])


def aggregate(codes: list[list[int]], refs: list[list[int]], lo: int, hi: int,
              columns: int) -> dict:
    """Rows of per-block states over logical blocks [lo, hi) as at most `columns`
    columns of k blocks each: a cell is its blocks' most common state."""
    k = max(1, math.ceil((hi - lo) / columns))
    starts = list(range(lo, hi, k))
    cells, hover = [], []
    for row, row_refs in zip(codes, refs):
        cells.append([])
        hover.append([])
        for s in starts:
            part = row[s:s + k]
            if not part:
                cells[-1].append(STATES["empty"])
                hover[-1].append("")
                continue
            counts = Counter(part)
            cells[-1].append(counts.most_common(1)[0][0])
            what = ", ".join(f"{n} {LABELS[c]}" for c, n in counts.most_common())
            span = f"block {s}" if k == 1 else f"blocks {s}-{s + len(part) - 1}"
            hover[-1].append(f"{span}: {what}; max refs {max(row_refs[s:s + k])}")
    return {"starts": starts, "blocks_per_column": k, "cells": cells, "hover": hover}


class BlockTableView(EngineView):
    """Block tables of DP rank `rank`; with `ranks`, keeps those ranks' tables too so
    `show_rank` can switch between them with their whole history."""

    def __init__(self, engine, rank: int = 0, rows: int = 16, columns: int = 200,
                 ranks=None) -> None:
        self.rows, self.columns = rows, columns
        self.page = 0
        self.window: tuple[int, int] | None = None  # logical blocks drawn (first, last)
        self.models = {r: BlockTableModel(engine, r) for r in sorted({rank, *(ranks or ())})}
        super().__init__(self.models[rank])

    def show_rank(self, rank: int) -> None:
        self.model.listeners.remove(self._maybe_redraw)
        self.model = self.models[rank]
        self.model.listeners.append(self._maybe_redraw)
        self.page = 0
        self.redraw()

    def detach(self) -> None:
        for model in self.models.values():
            model.detach()

    def make_figure(self):
        n = len(COLORS)  # one flat band of colour per state
        scale = [[(i + e) / n, c] for i, c in enumerate(COLORS) for e in (0, 1)]
        fig = new_figure(
            200 + 24 * self.rows, title="Block tables",
            xaxis=dict(title=f"logical block ({self.model.block_size} tokens each)"),
            yaxis=dict(title="request", autorange="reversed", type="category"))
        fig.add_heatmap(z=[], colorscale=scale, zmin=-0.5, zmax=n - 0.5, xgap=0, ygap=1,
                        colorbar=dict(tickvals=list(range(1, n)), ticktext=LABELS[1:],
                                      title=dict(text="block")),
                        hovertemplate="%{y}<br>%{customdata}<extra></extra>")
        return fig

    def zoom(self, first: int | None = None, last: int | None = None) -> None:
        """Draw logical blocks first..last only (block by block when they fit);
        no arguments: whole tables."""
        self.window = None if first is None else (first, last)
        self.redraw()

    def figure_data(self, upto_step=None) -> dict:
        data = self.model.tables(upto_step)
        pages = max(1, math.ceil(len(data["requests"]) / self.rows))
        page = min(self.page, pages - 1)
        rows = slice(page * self.rows, (page + 1) * self.rows)
        shown = data["requests"][rows]
        width = max((len(b) for b in data["blocks"][rows]), default=0)
        lo, hi = 0, width
        if self.window is not None:
            lo = max(0, self.window[0])
            hi = min(width, max(lo + 1, self.window[1] + 1))
        grid = aggregate(data["state"][rows], data["refs"][rows], lo, hi, self.columns)
        data.update(page=page, pages=pages, shown=shown, **grid)
        return data

    def draw(self, data: dict) -> None:
        heat = self.figure.data[0]
        rank = data["rank"]
        if not data["requests"]:
            heat.z, heat.x, heat.y = [], [], []
            self.figure.layout.title.text = f"Block tables, DP rank {rank}"
            empty_state(self.figure, f"no request holds KV on DP rank {rank} at this step")
            return
        empty_state(self.figure, None)
        k = data["blocks_per_column"]
        heat.x = [s + (k - 1) / 2 for s in data["starts"]]
        heat.y = data["shown"]
        heat.z = data["cells"]
        heat.customdata = data["hover"]
        self.figure.layout.height = 190 + 26 * max(len(data["shown"]), 4)
        first = data["page"] * self.rows
        paging = (f"; requests {first + 1}-{first + len(data['shown'])} of "
                  f"{len(data['requests'])} (page {data['page'] + 1}/{data['pages']})"
                  if data["pages"] > 1 else "")
        scale = f"; a column = {k} blocks (most common state)" if k > 1 else ""
        self.figure.layout.title.text = (
            f"Block tables, DP rank {rank}<br><sup>{data['blocks_in_use']} blocks in use, "
            f"{data['shared_blocks']} shared, {data['cached_free_blocks']} cached free"
            f"{paging}{scale}</sup>")

    def show_page(self, page: int) -> None:
        self.page = page
        self.redraw()
