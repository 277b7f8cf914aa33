"""What every view shares: a model fed by events, a figure redrawn from it, sparingly.

A view is two things. Its **model** is plain Python: it subscribes to the engine's
events and keeps exactly what the view would draw, step by step — so a test can run
an engine, then compare the model with what the engine did, with no browser at all.
Its **figure** (a plotly `FigureWidget`) is redrawn from the model inside one
`batch_update`, at most every `min_interval_s` of wall time, however fast events
arrive: a long replay stays responsive.

Every model also remembers *when* things happened in steps (`steps_done`, the number
of steps its engine has completed), so a view can show a finished run as it was at
any step (`show_step`), which the dashboard's slider uses.
"""

from __future__ import annotations

import time

from labkit.engine.events import StepsCompleted


class EventModel:
    """Subscribes to `kinds` (plus StepsCompleted, its clock) on an engine's bus."""

    kinds: tuple = ()

    def __init__(self, engine) -> None:
        self.engine = engine
        self.steps_done = 0
        self._subscription = engine.events.subscribe(self._on_event, StepsCompleted,
                                                     *self.kinds)
        self.listeners: list = []

    def _on_event(self, event) -> None:
        self.on_event(event)
        if isinstance(event, StepsCompleted):
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

    def __init__(self, model: EventModel, figure=None) -> None:
        self.model = model
        self.figure = figure if figure is not None else self.make_figure()
        self.shown_step: int | None = None  # None: follow the engine live
        self._last_draw = 0.0
        self.redraws = 0
        model.listeners.append(self._maybe_redraw)
        self.redraw()

    # -- to implement ------------------------------------------------------------
    def make_figure(self):  # pragma: no cover
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

    def _ipython_display_(self):  # shown as its figure in a notebook
        from IPython.display import display

        display(self.figure)
