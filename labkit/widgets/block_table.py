"""BlockTableView: each running request's block table on one DP rank, block by block.

A row per request, a column per logical block; a cell is the physical block holding
that part of the request's KV, coloured by what the block is:

- *own*: referenced by this request only, not (yet) in the prefix cache;
- *cached*: full, and registered in the prefix cache under its key;
- *shared*: referenced by several requests (prefix hits of concurrent calls);
- *forked*: received from a parent at a fork (a subagent's inherited context);
- *from CPU* / *from disk*: loaded from the node's offload tiers (`KVLoaded`).

The model rebuilds the tables from block events alone (`CacheHit`, `Forked`,
`BlocksAllocated`, `CopyOnWrite`, `BlocksFreed`, `BlocksCached`, `BlocksEvicted`,
`KVLoaded`) — it
never looks inside the KV manager — so comparing it with the manager's own tables
checks both. It also counts cached free blocks: freed, still holding reusable KV.
"""

from __future__ import annotations

from collections import Counter

from labkit.engine.events import (
    BlocksAllocated, BlocksCached, BlocksEvicted, BlocksFreed, CacheHit, CopyOnWrite, Forked,
    KVLoaded,
)
from labkit.widgets.base import EngineView, EventModel

STATES = {"empty": 0, "own": 1, "cached": 2, "shared": 3, "forked": 4, "cpu": 5, "disk": 6}
COLORS = ["#FFFFFF", "#9ECAE9", "#54A24B", "#F58518", "#B279A2", "#E45756", "#72B7B2"]


class BlockState:
    """The block tables of one rank, as block events describe them."""

    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}
        self.forked: dict[str, set[int]] = {}
        self.loaded: dict[str, dict[int, str]] = {}  # request -> block -> tier it came from
        self.keyed: set[int] = set()

    def apply(self, event) -> None:
        if isinstance(event, CacheHit):
            self.tables[event.request_id] = event.blocks.tolist()
        elif isinstance(event, Forked):
            self.tables[event.child_id] = event.blocks.tolist()
            self.forked[event.child_id] = set(event.blocks.tolist())
        elif isinstance(event, BlocksAllocated):
            self.tables.setdefault(event.request_id, []).extend(event.blocks.tolist())
        elif isinstance(event, CopyOnWrite):
            table = self.tables[event.request_id]
            table[table.index(event.src_block)] = event.dst_block
            self.forked.get(event.request_id, set()).discard(event.src_block)
        elif isinstance(event, KVLoaded):
            self.loaded[event.request_id] = dict(zip(event.blocks.tolist(), event.block_tiers))
        elif isinstance(event, BlocksFreed):
            self.tables.pop(event.request_id, None)
            self.forked.pop(event.request_id, None)
            self.loaded.pop(event.request_id, None)
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
        if block in self.forked.get(request_id, ()):
            return STATES["forked"]
        tier = self.loaded.get(request_id, {}).get(block)
        if tier is not None:
            return STATES[tier]
        if refs[block] > 1:
            return STATES["shared"]
        return STATES["cached"] if block in self.keyed else STATES["own"]


class BlockTableModel(EventModel):
    kinds = (CacheHit, Forked, BlocksAllocated, CopyOnWrite, BlocksFreed, BlocksCached,
             BlocksEvicted, KVLoaded)

    def __init__(self, engine, rank: int = 0) -> None:
        self.rank = rank
        self.live = BlockState()
        # (step the event belongs to, event), for replays: events between the end of
        # step k and the end of step k+1 (its allocations, its frees) belong to k+1
        self.log: list[tuple[int, object]] = []
        super().__init__(engine)

    def on_event(self, event) -> None:
        if getattr(event, "rank", None) != self.rank:
            return
        self.live.apply(event)
        self.log.append((self.steps_done + 1, event))

    def state_at(self, upto_step: int | None = None) -> BlockState:
        """The tables as they were when step `upto_step` had just completed (with
        fast-forward on, a run's block events all belong to its first step)."""
        if upto_step is None:
            return self.live
        state = BlockState()
        for seq, event in self.log:
            if seq > upto_step:
                break
            state.apply(event)
        return state

    def grid(self, upto_step: int | None = None, max_requests: int = 24,
             max_blocks: int = 512) -> dict:
        state = self.state_at(upto_step)
        refs = state.ref_counts()
        requests = list(state.tables)[-max_requests:]
        width = min(max((len(state.tables[r]) for r in requests), default=0), max_blocks)
        blocks, codes = [], []
        for rid in requests:
            table = state.tables[rid][:width]
            blocks.append(table + [-1] * (width - len(table)))
            codes.append([state.cell_state(rid, b, refs) for b in table]
                         + [STATES["empty"]] * (width - len(table)))
        return {"rank": self.rank, "requests": requests, "blocks": blocks, "state": codes,
                "cached_free_blocks": len(state.cached_free()),
                "blocks_in_use": len(refs)}


class BlockTableView(EngineView):
    def __init__(self, engine, rank: int = 0, max_requests: int = 24,
                 max_blocks: int = 512) -> None:
        self.max_requests, self.max_blocks = max_requests, max_blocks
        super().__init__(BlockTableModel(engine, rank))

    def make_figure(self):
        import plotly.graph_objects as go

        n = len(COLORS)  # one flat band of colour per state
        scale = [[(i + e) / n, c] for i, c in enumerate(COLORS) for e in (0, 1)]
        fig = go.FigureWidget(layout=dict(
            height=360, margin=dict(l=120, r=10, t=40, b=40),
            xaxis_title="logical block", yaxis=dict(autorange="reversed")))
        fig.add_heatmap(z=[], colorscale=scale, zmin=-0.5, zmax=n - 0.5, showscale=True,
                        colorbar=dict(tickvals=list(range(n)), ticktext=list(STATES)),
                        hovertemplate="block %{x}: physical %{text}<extra>%{y}</extra>")
        return fig

    def figure_data(self, upto_step=None) -> dict:
        return self.model.grid(upto_step, self.max_requests, self.max_blocks)

    def draw(self, data: dict) -> None:
        heat = self.figure.data[0]
        heat.z = data["state"]
        heat.y = data["requests"]
        heat.text = data["blocks"]
        self.figure.layout.title = (
            f"Block tables, rank {data['rank']}: {data['blocks_in_use']} blocks in use, "
            f"{data['cached_free_blocks']} cached free")
