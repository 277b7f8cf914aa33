"""What every view shares: a model fed by events, a figure redrawn from it, sparingly.

A view is two things. Its **model** is plain Python: it subscribes to the engine's
events and keeps exactly what the view would draw, step by step — so a test can run
an engine, then compare the model with what the engine did, with no browser at all.
Its **figure** (a plotly `Figure`) is redrawn from the model at most every
`min_interval_s` of wall time, however fast events arrive, and shown in the view's
`widget` (an ipywidgets `Output`): a long replay stays responsive.

Why not plotly's `FigureWidget`? It draws whatever state reached the browser before
its own code finished loading — a figure updated in that window, or one shown inside
a container, comes up empty, and it never resizes to its cell. A figure sent whole
to plotly's own renderer, redrawn by replacing it, always shows what the model holds
and follows the notebook's width.

**Steps.** Every model numbers the steps its engine completes, in the order their
`StepsCompleted` events arrive (`steps_done`; with DEP one lockstep step of all ranks
is one step), so a view can show the run as it was after any step (`show_step`) —
the dashboard's *step* button and slider. The engine may fast-forward a run of
steady decode steps in one go; its events still carry the exact times of their
steps, so a model places each event in its step by time (`StepClock.includes`): an
event belongs to the state after step k of its instance if it happened before that
step ended, or at its very end and is an end-of-step event (caching, freeing) that
arrived before the step was reported. Allocations at that instant open the next step.

Figures take the notebook's width (`autosize` and plotly's `responsive` config),
label every axis with its unit, and draw an explicit empty state, not a bare axis.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import math
import time

from labkit.engine.events import StepsCompleted


class StepClock:
    """When each step ended, per instance, in arrival order (steps are numbered 1, 2, ...)."""

    def __init__(self, engine) -> None:
        self.instance_of_rank = {r: inst.index for inst in engine.instances for r in inst.ranks}
        self.seqs: dict[int, list[int]] = {inst.index: [] for inst in engine.instances}
        self.ends: dict[int, list[float]] = {inst.index: [] for inst in engine.instances}

    def record(self, event: StepsCompleted, first_seq: int) -> None:
        ends = (event.start + event.duration).tolist()
        self.seqs[event.instance].extend(range(first_seq, first_seq + len(ends)))
        self.ends[event.instance].extend(ends)

    def last_step(self, rank: int, upto_step: int) -> tuple[int, float]:
        """(step number, end time) of the latest step of `rank`'s instance numbered
        <= upto_step; (0, -inf) before its first."""
        inst = self.instance_of_rank[rank]
        i = bisect.bisect_right(self.seqs[inst], upto_step)
        return (self.seqs[inst][i - 1], self.ends[inst][i - 1]) if i else (0, -math.inf)

    def includes(self, t: float, tag: int, end_of_step: bool, step: tuple[int, float]) -> bool:
        """Does an event at time t, which arrived while step `tag` was next, belong to
        the state after `step` = (number, end)? (See the module docstring.)"""
        seq, end = step
        return t < end or (t == end and end_of_step and tag <= seq)

    def cut(self, log: list, step: tuple[int, float]) -> int:
        """How many entries of a rank's log, (t, tag, end_of_step, ...) in arrival
        order, belong to the state after `step`: they are a prefix of the log."""
        return bisect.bisect_left(log, True, key=lambda e: not self.includes(*e[:3], step))


class EventModel:
    """Subscribes to `kinds` (plus StepsCompleted, its clock) on an engine's bus."""

    kinds: tuple = ()

    def __init__(self, engine) -> None:
        self.engine = engine
        self.steps_done = 0
        self.clock = StepClock(engine)
        self._subscription = engine.events.subscribe(self._on_event, StepsCompleted,
                                                     *self.kinds)
        self.listeners: list = []

    def _on_event(self, event) -> None:
        self.on_event(event)
        if isinstance(event, StepsCompleted):
            self.clock.record(event, self.steps_done + 1)
            self.steps_done += len(event.step_index)
        for listener in self.listeners:
            listener()

    def on_event(self, event) -> None:  # pragma: no cover - each model implements it
        raise NotImplementedError

    def detach(self) -> None:
        self._subscription.unsubscribe()


class EngineView:
    """A figure kept in step with a model, redrawn at most every min_interval_s."""

    min_interval_s = 0.25

    def __init__(self, model: EventModel) -> None:
        self.model = model
        self.shown_step: int | None = None  # None: follow the engine live
        self._last_draw = 0.0
        self.redraws = 0
        self.figure = plain(self.make_figure())
        self.widget = FigureOutput()
        self.redraw()
        model.listeners.append(self._maybe_redraw)

    # -- to implement ------------------------------------------------------------
    def make_figure(self):  # pragma: no cover
        """The figure with all its traces, empty (a plotly Figure)."""
        raise NotImplementedError

    def figure_data(self, upto_step: int | None = None) -> dict:  # pragma: no cover
        """What the figure shows (as of step `upto_step`), as plain Python."""
        raise NotImplementedError

    def draw(self, data: dict) -> None:  # pragma: no cover
        raise NotImplementedError

    # -- drawing -------------------------------------------------------------------
    def _maybe_redraw(self) -> None:
        if self.shown_step is None and time.monotonic() - self._last_draw >= self.min_interval_s:
            self.redraw()

    def redraw(self) -> None:
        data = self.figure_data(self.shown_step)
        with self.figure.batch_update():
            self.draw(data)
        self.widget.show(self.figure)
        self._last_draw = time.monotonic()
        self.redraws += 1

    def flush(self) -> None:
        """Draw now, whatever the throttle says (call after a burst of steps)."""
        self.redraw()

    def show_step(self, step: int | None) -> None:
        """Show the run as it was after `step` steps (None: follow live)."""
        self.shown_step = step
        self.redraw()

    def detach(self) -> None:
        self.model.detach()

    def _ipython_display_(self):  # shown as its widget in a notebook
        from IPython.display import display

        display(self.widget)
        refresh_soon([self.widget])


# ------------------------------------------------------------------ figure helpers
def FigureOutput():  # noqa: N802 - reads as the widget class it builds
    """An ipywidgets Output that shows one plotly figure at the width of its cell."""
    import ipywidgets as widgets

    class _FigureOutput(widgets.Output):
        def show(self, figure) -> None:
            """Replace what is shown with `figure`, sent whole to plotly's renderer.

            The figure goes in the widget's state (`outputs`), not through the
            kernel's output stream: nothing is written into the notebook's cells, and
            what `nbval` compares stays the cells' own output."""
            spec = json.loads(figure.to_json())  # numpy and NaN made plain JSON
            bundle = {PLOTLY_MIME: {"data": spec.get("data", []),
                                    "layout": spec.get("layout", {}), "config": CONFIG},
                      "text/plain": f"<figure: {figure.layout.title.text or ''}>"}
            self.outputs = ({"output_type": "display_data", "data": bundle, "metadata": {}},)

        def refresh(self) -> None:
            """Have the browser draw the figure again (now that it is on the page)."""
            shown, self.outputs = self.outputs, ()
            self.outputs = shown

    return _FigureOutput(layout=widgets.Layout(width="100%"))


def refresh_soon(outputs, delays=(0.3, 1.5)) -> None:
    """Draw figures (`FigureOutput`s) again shortly after they are put on screen, on
    the kernel's event loop.

    A figure the browser renders before its output is attached to the page (a new
    dashboard, a rebuild's fresh views) comes up zero pixels tall; drawing it again
    once it is on the page fixes that. Outside a kernel there is no page: no-op."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    for delay in delays:
        loop.call_later(delay, lambda: [output.refresh() for output in outputs])


PLOTLY_MIME = "application/vnd.plotly.v1+json"
CONFIG = {"responsive": True, "displaylogo": False}


def plain(figure):
    """A plain plotly Figure of `figure` (a FigureWidget is copied, then closed)."""
    import plotly.graph_objects as go

    if isinstance(figure, go.FigureWidget):
        copy = go.Figure(figure)
        figure.close()
        return copy
    return figure


def new_figure(height: int, **layout):
    """A figure that fills the notebook's width (no fixed width: plotly autosizes it
    to its cell) with room for a legend above the plot."""
    import plotly.graph_objects as go

    base = dict(autosize=True, height=height, margin=dict(l=70, r=20, t=75, b=50),
                legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="right", x=1.0),
                template="plotly_white")
    base.update(layout)
    return go.Figure(layout=base)


def empty_state(figure, message: str | None) -> None:
    """Hide the axes and say why nothing is drawn (or restore them: message None)."""
    shown = message is None
    figure.for_each_xaxis(lambda axis: axis.update(visible=shown))
    figure.for_each_yaxis(lambda axis: axis.update(visible=shown))
    notes = [a for a in figure.layout.annotations if a.name != "empty"]
    if not shown:
        notes.append(dict(name="empty", text=message, x=0.5, y=0.5, xref="paper",
                          yref="paper", showarrow=False, font=dict(size=14, color="#666")))
    figure.layout.annotations = notes
