"""LockstepView: DP ranks x time, coloured by how much of each moment a rank stalled.

Under DEP every step lasts as long as its slowest rank; the others wait. A step of a
rank is its own work (`busy`: compute, communication, overhead) followed by its
*stall* — the wait for the slowest rank. Over a whole run there are thousands of steps,
far more than pixels, so the view bins time: each cell is one rank over one time bin,
coloured by the share of the time it spent in steps that it stalled
(`stall / (busy + stall)`, in %). Bins where a rank ran no step stay grey. A prefill on
one rank stalling all the others shows as a red column with one white cell.

Zoom with the range slider under the plot (or drag over it); `view.zoom(t0, t1)` bins
just that range, down to single steps. Data: `StepsCompleted` only; `model.frame()`
is every step of every rank, `figure_data()` the binned grid.
"""

from __future__ import annotations

import bisect

import numpy as np

from labkit.engine.events import StepsCompleted
from labkit.widgets.base import EngineView, EventModel, empty_state, new_figure

COLUMNS = ("seq", "instance", "step_index", "rank", "start_s", "duration_s", "busy_s",
           "compute_s", "comm_s", "stall_s", "prefill_tokens", "decode_tokens",
           "num_prefill_reqs", "num_decode_reqs")


class LockstepModel(EventModel):
    def __init__(self, engine) -> None:
        self.ranks: list[int] = [r for inst in engine.instances for r in inst.ranks]
        self._chunks: list[dict] = []  # one per StepsCompleted event, columns as arrays
        self._seq_ends: list[int] = []  # last step number of each chunk
        self._ended_by: list[float] = []  # per step number - 1: latest end up to that step
        super().__init__(engine)

    def on_event(self, event) -> None:
        if not isinstance(event, StepsCompleted):
            return
        k, r = event.busy.shape
        first = self.steps_done + 1
        other = event.busy - event.compute - event.comm  # per-step overhead counts as compute
        self._chunks.append({
            "seq": np.repeat(np.arange(first, first + k), r),
            "instance": np.full(k * r, event.instance),
            "step_index": np.repeat(event.step_index, r),
            "rank": np.tile(event.ranks, k),
            "start_s": np.repeat(event.start, r),
            "duration_s": np.repeat(event.duration, r),
            "busy_s": event.busy.ravel(), "compute_s": (event.compute + other).ravel(),
            "comm_s": event.comm.ravel(), "stall_s": event.stall.ravel(),
            "prefill_tokens": event.prefill_tokens.ravel(),
            "decode_tokens": event.decode_tokens.ravel(),
            "num_prefill_reqs": event.num_prefill_reqs.ravel(),
            "num_decode_reqs": event.num_decode_reqs.ravel(),
        })
        self._seq_ends.append(first + k - 1)
        latest = self._ended_by[-1] if self._ended_by else 0.0
        self._ended_by.extend(np.maximum.accumulate(
            np.maximum(event.start + event.duration, latest)).tolist())

    def columns(self, upto_step: int | None = None) -> dict[str, np.ndarray]:
        """Every step of every rank so far (as of `upto_step`), column by column."""
        n = len(self._chunks) if upto_step is None else \
            bisect.bisect_left(self._seq_ends, upto_step) + 1
        chunks = self._chunks[:n]
        if not chunks:
            return {c: np.zeros(0) for c in COLUMNS}
        out = {c: np.concatenate([ch[c] for ch in chunks]) for c in COLUMNS}
        if upto_step is not None:
            keep = out["seq"] <= upto_step
            out = {c: v[keep] for c, v in out.items()}
        return out

    def frame(self, upto_step: int | None = None):
        """One row per rank per step (a pandas DataFrame; seconds and tokens)."""
        import pandas as pd

        return pd.DataFrame(self.columns(upto_step), columns=list(COLUMNS))

    def steps_by(self, t: float) -> int:
        """The most steps n such that steps 1..n had all ended by time t."""
        return bisect.bisect_right(self._ended_by, t)

    def step(self, seq: int) -> dict[str, np.ndarray]:
        """The rows of step number `seq` (one per rank of its instance)."""
        i = bisect.bisect_left(self._seq_ends, seq)
        if i == len(self._chunks):
            return {c: np.zeros(0) for c in COLUMNS}
        chunk = self._chunks[i]
        keep = chunk["seq"] == seq
        return {c: v[keep] for c, v in chunk.items()}

    def binned(self, upto_step: int | None = None, bins: int = 240,
               window: tuple[float, float] | None = None) -> dict:
        """Per rank and time bin: seconds busy and stalled, tokens prefilled.

        Time in a bin is exact: each step is the interval [start, start + busy) of work
        then [start + busy, start + duration) of stall, and a bin gets the overlap."""
        cols = self.columns(upto_step)
        end = float((cols["start_s"] + cols["duration_s"]).max()) if len(cols["seq"]) else 0.0
        lo, hi = window if window is not None else (0.0, end)
        hi = max(hi, lo + 1e-9)
        edges = np.linspace(lo, hi, bins + 1)
        n = len(self.ranks)
        busy, stall, prefill = (np.zeros((n, bins)) for _ in range(3))
        for i, rank in enumerate(self.ranks):
            mine = cols["rank"] == rank
            start, dur = cols["start_s"][mine], cols["duration_s"][mine]
            work = cols["busy_s"][mine]
            busy[i] = np.diff(_time_in(edges, start, start + work))
            stall[i] = np.diff(_time_in(edges, start + work, start + dur))
            inside = (start >= lo) & (start < hi)
            prefill[i] = np.histogram(start[inside], edges,
                                      weights=cols["prefill_tokens"][mine][inside])[0]
        stepping = busy + stall
        with np.errstate(invalid="ignore", divide="ignore"):
            share = np.where(stepping > 0, 100.0 * stall / stepping, np.nan)
        return {"ranks": self.ranks, "edges": edges, "busy_s": busy, "stall_s": stall,
                "stall_share": share, "prefill_tokens": prefill,
                "steps": int(len(set(cols["seq"].tolist()))), "end_s": end}


def _time_in(edges: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """How much of the disjoint, ordered intervals [starts, ends) lies before each edge."""
    if not len(starts):
        return np.zeros(len(edges))
    lengths = ends - starts
    before = np.concatenate([[0.0], np.cumsum(lengths)[:-1]])
    xp = np.column_stack([starts, ends]).ravel()
    fp = np.column_stack([before, before + lengths]).ravel()
    return np.interp(edges, xp, fp, left=0.0, right=float(fp[-1]))


class LockstepView(EngineView):
    """Heatmap: DP ranks x time, colour = stall share of the time spent in steps (%)."""

    def __init__(self, engine, bins: int = 600) -> None:
        self.bins = bins
        self.window: tuple[float, float] | None = None  # the time range binned
        super().__init__(LockstepModel(engine))

    def make_figure(self):
        fig = new_figure(
            120 + 22 * len(self.model.ranks) + 60,
            title="Lockstep: share of each rank's step time spent stalled",
            xaxis=dict(title="time (s)", rangeslider=dict(visible=True, thickness=0.08)),
            yaxis=dict(title="DP rank", autorange="reversed"),
            plot_bgcolor="#e5e5e5")
        fig.add_heatmap(
            z=[], x=[], y=[], zmin=0, zmax=100, colorscale="Reds",
            colorbar=dict(title=dict(text="stalled, % of step time", side="right"),
                          ticksuffix=" %", len=1.0, thickness=14),
            hovertemplate="%{y}, t = %{x:.3f} s: stalled %{z:.0f} % of its step time<br>"
                          "busy %{customdata[0]:.1f} ms, stalled %{customdata[1]:.1f} ms, "
                          "%{customdata[2]} prefill tokens<extra></extra>")
        return fig

    def zoom(self, start_s: float | None = None, end_s: float | None = None) -> None:
        """Bin only [start_s, end_s) (finer columns); no arguments: the whole run."""
        self.window = None if start_s is None else (start_s, end_s)
        self.redraw()

    def figure_data(self, upto_step=None) -> dict:
        return self.model.binned(upto_step, self.bins, self.window)

    def draw(self, data: dict) -> None:
        heat = self.figure.data[0]
        if data["steps"] == 0:
            heat.z, heat.x, heat.y = [], [], []
            empty_state(self.figure, "no step has run yet")
            return
        empty_state(self.figure, None)
        edges = data["edges"]
        width = float(edges[1] - edges[0])
        heat.x = ((edges[:-1] + edges[1:]) / 2).tolist()
        heat.y = [f"rank {r}" for r in data["ranks"]]
        heat.z = np.where(np.isnan(data["stall_share"]), None, data["stall_share"]).tolist()
        heat.customdata = np.stack([1e3 * data["busy_s"], 1e3 * data["stall_s"],
                                    data["prefill_tokens"]], axis=-1).round(2)
        self.figure.layout.title.text = (
            f"Lockstep: share of each rank's step time spent stalled<br><sup>"
            f"{data['steps']} steps; a column = {1e3 * width:.3g} ms; grey: no step</sup>")
