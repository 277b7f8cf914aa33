"""LockstepView: per DP rank and step, compute, communication and stall time.

Under DEP every step lasts as long as its slowest rank; the others wait. Each bar of
this view is one rank in one step: its compute, its communication, and its *stall*
(how long it waited for the slowest rank) stacked up to the step's duration. The data
comes from `StepsCompleted` events only.
"""

from __future__ import annotations

import bisect

import numpy as np

from labkit.engine.events import StepsCompleted
from labkit.widgets.base import EngineView, EventModel


class LockstepModel(EventModel):
    def __init__(self, engine) -> None:
        self.ranks: list[int] = [r for inst in engine.instances for r in inst.ranks]
        self._rows: list[tuple] = []  # (step_seq, step_index, rank, compute, comm, stall)
        super().__init__(engine)

    def on_event(self, event) -> None:
        if not isinstance(event, StepsCompleted):
            return
        k, r = event.busy.shape
        seq = self.steps_done + np.repeat(np.arange(1, k + 1), r)
        other = event.busy - event.compute - event.comm  # the per-step overhead
        self._rows.extend(zip(seq.tolist(), np.repeat(event.step_index, r).tolist(),
                              np.tile(event.ranks, k).tolist(),
                              (event.compute + other).ravel().tolist(),
                              event.comm.ravel().tolist(), event.stall.ravel().tolist()))

    def table(self, upto_step: int | None = None, last: int = 50) -> dict:
        """The last `last` completed steps (as of `upto_step`): per rank, per step."""
        end = len(self._rows)
        if upto_step is not None:
            end = bisect.bisect_right(self._rows, (upto_step, np.inf))
        start, seen = end, set()
        while start > 0 and (self._rows[start - 1][0] in seen or len(seen) < last):
            seen.add(self._rows[start - 1][0])
            start -= 1
        rows = self._rows[start:end]
        seqs = sorted(seen)
        pos = {s: i for i, s in enumerate(seqs)}
        out = {"steps": seqs, "ranks": self.ranks}
        for name, col in (("compute", 3), ("comm", 4), ("stall", 5)):
            grid = {rank: [0.0] * len(seqs) for rank in self.ranks}
            for r in rows:
                grid[r[2]][pos[r[0]]] = r[col]
            out[name] = grid
        return out


class LockstepView(EngineView):
    """Stacked bars: for each DP rank, its compute / comm / stall per step (ms)."""

    def __init__(self, engine, last: int = 50) -> None:
        self.last = last
        super().__init__(LockstepModel(engine))

    def make_figure(self):
        import plotly.graph_objects as go

        fig = go.FigureWidget(layout=dict(
            barmode="stack", height=320, margin=dict(l=50, r=10, t=40, b=40),
            title="Lockstep: compute, communication and stall per rank per step",
            xaxis_title="step (rank by rank)", yaxis_title="ms"))
        colors = {"compute": "#4C78A8", "comm": "#F58518", "stall": "#E45756"}
        for name, color in colors.items():
            fig.add_bar(name=name, marker_color=color, x=[], y=[])
        return fig

    def figure_data(self, upto_step=None) -> dict:
        return self.model.table(upto_step, self.last)

    def draw(self, data: dict) -> None:
        x = [f"{s}/r{rank}" for s in data["steps"] for rank in data["ranks"]]
        for trace, name in zip(self.figure.data, ("compute", "comm", "stall")):
            grid = data[name]
            trace.x = x
            trace.y = [1e3 * grid[rank][i] for i in range(len(data["steps"]))
                       for rank in data["ranks"]]
