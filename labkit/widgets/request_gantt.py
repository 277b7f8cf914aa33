"""RequestGantt: each call's life on one time axis — queue, prefill chunks, decode.

One row per call, in arrival order: grey while it waits in its rank's queue, orange
while it prefills (each chunk, one step's worth of its prompt, drawn darker inside),
green while its prefix KV arrives from another rank or an offload tier, blue while it
decodes. A preempted call goes grey again and recomputes. It is the notebook face of
the same phases the Perfetto timeline writes (`labkit.exporters.RequestPhases`), fed
by the same events. With many calls it shows the latest `max_calls` and says so in its
title; `view.phases()` has every row.
"""

from __future__ import annotations

import pandas as pd

from labkit.engine.events import StepsCompleted
from labkit.exporters.request_phases import RequestPhases
from labkit.widgets.base import EngineView, EventModel

COLORS = {"queue": "#BAB0AC", "prefill": "#F58518", "chunk": "#C4480B",
          "kv_fetch": "#54A24B", "kv_load": "#54A24B", "decode": "#4C78A8"}
LABELS = {"queue": "queue", "prefill": "prefill", "chunk": "prefill chunk (one step)",
          "kv_fetch": "KV arriving", "kv_load": "KV arriving", "decode": "decode"}


class RequestGanttModel(EventModel):
    kinds = RequestPhases.KINDS

    def __init__(self, engine) -> None:
        self.request_phases = RequestPhases(engine)
        self.step_ends: list[float] = []  # end of the n-th completed step, n = 1, 2, ...
        super().__init__(engine)

    def on_event(self, event) -> None:
        if isinstance(event, StepsCompleted):
            ends = (event.start + event.duration).tolist()
            # steps of different instances may arrive out of time order
            for t in ends:
                self.step_ends.append(max(t, self.step_ends[-1]) if self.step_ends else t)
            return
        self.request_phases.on_event(event)

    def phases(self, upto_step: int | None = None) -> pd.DataFrame:
        """The phases as they stood when `upto_step` steps had completed (None: now)."""
        if upto_step is None or not self.step_ends:
            return self.request_phases.frame()
        t = self.step_ends[min(max(upto_step, 1), len(self.step_ends)) - 1]
        frame = self.request_phases.frame(now=t)
        frame = frame[frame["start_s"] <= t].copy()
        frame["end_s"] = frame["end_s"].clip(upper=t)
        return frame.reset_index(drop=True)


class RequestGantt(EngineView):
    """Gantt chart of the calls (see the module docstring)."""

    def __init__(self, engine, max_calls: int = 40) -> None:
        self.max_calls = max_calls
        super().__init__(RequestGanttModel(engine))

    def make_figure(self):
        import plotly.graph_objects as go

        fig = go.FigureWidget(layout=dict(
            barmode="overlay", height=300, margin=dict(l=10, r=10, t=50, b=10),
            title="Calls: queue, prefill, decode",
            legend=dict(orientation="h", x=0, y=-0.08, yanchor="top"),
            xaxis=dict(title="simulated time (s)", automargin=True),
            yaxis=dict(title="call (arrival order)", autorange="reversed", automargin=True)))
        for phase in ("queue", "prefill", "kv_load", "chunk", "decode"):
            fig.add_bar(name=LABELS[phase], orientation="h", marker_color=COLORS[phase],
                        width=0.45 if phase == "chunk" else 0.8, x=[], y=[], base=[],
                        hovertemplate="%{y}<br>" + phase + ": %{base:.3f} s + %{x:.3f} s"
                                      "<extra></extra>")
        return fig

    def phases(self, upto_step: int | None = None) -> pd.DataFrame:
        """Every call's phases (the table the figure draws from)."""
        return self.model.phases(upto_step)

    def figure_data(self, upto_step=None) -> dict:
        frame = self.model.phases(upto_step)
        calls = frame.loc[frame["phase"] == "request"].sort_values("order")["request_id"]
        shown = list(calls)[-self.max_calls:] if self.max_calls else list(calls)
        rows = frame[frame["request_id"].isin(shown) & (frame["phase"] != "request")]
        return {"calls": shown, "total": len(calls), "rows": rows}

    def draw(self, data: dict) -> None:
        rows = data["rows"]
        groups = {"queue": ["queue"], "prefill": ["prefill"], "kv_load": ["kv_load", "kv_fetch"],
                  "chunk": ["chunk"], "decode": ["decode"]}
        for trace, phases in zip(self.figure.data, groups.values()):
            part = rows[rows["phase"].isin(phases)]
            trace.y = part["request_id"].tolist()
            trace.base = part["start_s"].tolist()
            trace.x = (part["end_s"] - part["start_s"]).tolist()
        shown, total = len(data["calls"]), data["total"]
        title = "Calls: queue, prefill, decode"
        if shown < total:
            title += f" — the latest {shown} of {total} calls (view.phases() has all)"
        self.figure.layout.title.text = title
        self.figure.layout.height = 170 + 18 * max(shown, 3)
        self.figure.layout.yaxis.categoryarray = data["calls"]
        self.figure.layout.yaxis.categoryorder = "array"
