"""Dashboard: the views over one engine, with the knobs people turn.

Pick a model, hardware and layout (the lists hold only what the model allows), the
workload (concurrency, duration) and scheduler knobs (`long_prefill_token_threshold`,
`prefill_schedule_interval`, router); *rebuild* makes a fresh engine and replays the
trace into fresh views. A rebuild the engine refuses clears the views and leaves the
refusal on screen until a rebuild succeeds: nothing stale stays to be mistaken for
the new layout.

**One step is one engine step.** The engine may simulate a run of steady decode
steps in one go (`sim_fast_forward`, on: same results, much faster), but every view
keeps each step — the block tables place each event in its step by time — so *step*
shows exactly the next step, computing more only when the views have shown all they
have. *play* does the same `steps/tick` at a time, without blocking the notebook (an
asyncio task on the kernel's loop); the *show step* slider goes back to any step, and
the status line always describes the step on screen.

Views are a list (`VIEWS`): each entry builds one view of an engine; a new view joins
the dashboard (and `Compare`) by joining the list. Everything is also a method
(`rebuild`, `step`, `run`, `show_step`), so a notebook, a test or a headless browser
drives the dashboard the same way.
"""

from __future__ import annotations

import asyncio
import html

import ipywidgets as widgets

from labkit.engine.engine import Engine
from labkit.errors import ConfigError
from labkit.specs.config import ROUTER_POLICIES
from labkit.widgets.base import refresh_soon
from labkit.widgets.block_table import BlockTableView
from labkit.widgets.controls import NARROW, DeploymentControls, quiet
from labkit.widgets.lockstep import LockstepView
from labkit.widgets.placement import KVPlacementView
from labkit.widgets.prefix_cache import PrefixCacheView
from labkit.widgets.rank_kv import RankKVView
from labkit.widgets.status import describe_step

# name -> how to build that view of an engine (rank: the DP rank the reader picked)
VIEWS = {
    "placement": lambda engine, rank: KVPlacementView(engine),
    "lockstep": lambda engine, rank: LockstepView(engine),
    "kv": lambda engine, rank: RankKVView(engine),
    "blocks": lambda engine, rank: BlockTableView(
        engine, rank, ranks=range(engine.layout.num_dp_ranks)),
    "prefix": lambda engine, rank: PrefixCacheView(engine),
}
FULL_WIDTH = widgets.Layout(width="100%")


def view_grid(items: list) -> widgets.GridBox:
    """Views' widgets in as many columns of >= 620 px as the notebook's width allows."""
    return widgets.GridBox(
        [widgets.Box([f], layout=FULL_WIDTH) for f in items],
        layout=widgets.Layout(width="100%", grid_gap="8px",
                              grid_template_columns="repeat(auto-fit, minmax(620px, 1fr))"))


class Dashboard(widgets.VBox):
    def __init__(self, trace, model: str = "deepseek-v3", layout: str = "dep8",
                 hardware: str = "h200", concurrency: int = 8, duration_s: float = 300.0,
                 rank: int = 0, **knobs) -> None:
        super().__init__(layout=FULL_WIDTH)
        self.trace = trace
        self.engine = None
        self.run_handle = None
        self.views: dict = {}
        self.error: str | None = None
        self._task = None
        self._syncing = False
        self.deployment = DeploymentControls(model, hardware, layout, dict(knobs))
        self.threshold = widgets.BoundedIntText(
            value=knobs.pop("long_prefill_token_threshold", 0), min=0, max=1 << 24,
            description="threshold", layout=widgets.Layout(width="12em"), **NARROW)
        self.interval = widgets.BoundedIntText(
            value=knobs.pop("prefill_schedule_interval", 1), min=1, max=1024,
            description="interval", layout=widgets.Layout(width="10em"), **NARROW)
        self.router = widgets.Dropdown(options=ROUTER_POLICIES,
                                       value=knobs.pop("router", "session_sticky"),
                                       description="router", **NARROW)
        self.knobs = knobs
        self.concurrency = widgets.BoundedIntText(
            value=concurrency, min=1, max=4096, description="concurrency",
            layout=widgets.Layout(width="11em"), **NARROW)
        self.duration = widgets.BoundedFloatText(
            value=duration_s, min=1, max=1e6, description="duration (s)",
            layout=widgets.Layout(width="12em"), **NARROW)
        self.rank = widgets.Dropdown(options=[rank], value=rank, description="DP rank",
                                     **NARROW)
        self.rebuild_button = widgets.Button(description="rebuild", icon="refresh",
                                             button_style="primary")
        self.busy = widgets.HTML()
        self.play_button = widgets.ToggleButton(description="play", icon="play")
        self.step_button = widgets.Button(description="step", icon="step-forward")
        self.speed = widgets.IntSlider(value=20, min=1, max=500, description="steps/tick",
                                       **NARROW)
        self.slider = widgets.IntSlider(value=0, min=0, max=0, description="show step",
                                        continuous_update=False,
                                        layout=widgets.Layout(width="40em"), **NARROW)
        self.status = widgets.HTML(layout=FULL_WIDTH)
        self.rebuild_button.on_click(lambda _: self.rebuild())
        self.step_button.on_click(lambda _: self.step())
        self.play_button.observe(self._play_toggled, names="value")
        self.slider.observe(self._slider_moved, names="value")
        self.rank.observe(self._rank_changed, names="value")
        row = widgets.Layout(flex_flow="row wrap", width="100%", align_items="center")
        self.controls = widgets.VBox([
            widgets.HBox(self.deployment.widgets, layout=row),
            widgets.HBox([self.concurrency, self.duration, self.threshold, self.interval,
                          self.router, self.rebuild_button, self.busy], layout=row),
            widgets.HBox([self.play_button, self.step_button, self.speed, self.slider,
                          self.rank], layout=row),
            self.status,
        ], layout=FULL_WIDTH)
        self.rebuild()

    # -------------------------------------------------------------- engine
    def rebuild(self) -> bool:
        """A fresh engine with the chosen settings, a fresh replay, fresh views.
        False (and the refusal on screen, no views) if the engine refuses them."""
        self.pause()
        model, hardware, layout = self.deployment.value()
        self._set_busy(f"building {layout} for {model} on {hardware} ...")
        self._drop_views()
        knobs = dict(self.knobs, long_prefill_token_threshold=self.threshold.value,
                     prefill_schedule_interval=self.interval.value, router=self.router.value)
        try:
            engine = Engine(model=model, layout=layout, hardware=hardware, **knobs)
            run = engine.start_replay(self.trace, concurrency=self.concurrency.value,
                                      duration_s=self.duration.value, start_part_way=False)
        except ConfigError as err:
            self.error = f"cannot build {layout} for {model} on {hardware}: {err}"
            self.status.value = (f"<b style='color:#c00'>{html.escape(self.error)}</b><br>"
                                 "<i>No views: pick a legal layout and press rebuild.</i>")
            self._set_busy(None)
            return False
        self.error = None
        self.engine, self.run_handle = engine, run
        ranks = list(range(engine.layout.num_dp_ranks))
        with quiet(self):
            self.rank.options = ranks
            self.rank.value = min(self.rank.value or 0, ranks[-1])
        self.views = {name: make(engine, self.rank.value) for name, make in VIEWS.items()}
        self.children = [self.controls, view_grid([v.widget for v in self.views.values()])]
        self.show_step(0)
        refresh_soon([v.widget for v in self.views.values()])
        self._set_busy(None)
        return True

    def _repr_mimebundle_(self, **kwargs):
        refresh_soon([v.widget for v in self.views.values()])
        return super()._repr_mimebundle_(**kwargs)

    def _drop_views(self) -> None:
        for view in self.views.values():
            view.detach()
            view.widget.close()  # the browser forgets it too
        self.views, self.engine, self.run_handle = {}, None, None
        self.children = [self.controls]
        with quiet(self):
            self.slider.max = self.slider.value = 0

    def _set_busy(self, message: str | None) -> None:
        for button in (self.rebuild_button, self.step_button, self.play_button):
            button.disabled = message is not None or (button is not self.rebuild_button
                                                      and self.error is not None)
        self.busy.value = "" if message is None else \
            f"<span style='color:#b60'>&#8987; {html.escape(message)}</span>"

    # ------------------------------------------------------------- stepping
    @property
    def steps_done(self) -> int:
        """Steps the engine has completed (the views keep every one of them)."""
        return self.views["lockstep"].model.steps_done if self.views else 0

    @property
    def shown_step(self) -> int:
        return self.slider.value

    def step(self, n: int = 1) -> bool:
        """Show the next n engine steps (computing them if the views do not have them
        yet). False when the replay is over and its last step is on screen."""
        if self.engine is None:
            return False
        target = self.shown_step + n
        alive = True
        while self.steps_done < target and (alive := self.engine.step()):
            pass
        self.show_step(min(target, self.steps_done))
        return alive or self.shown_step < self.steps_done

    def run(self) -> None:
        """Run to the end of the replay (no animation) and show its last step."""
        if self.engine is None:
            return
        while self.engine.step():
            pass
        self.show_step(self.steps_done)

    def show_step(self, step: int) -> None:
        """Show every view (and the status line) as they were after `step` steps."""
        if not self.views:
            return
        step = max(0, min(step, self.steps_done))
        for view in self.views.values():
            view.show_step(step)
        with quiet(self):
            self.slider.max = self.steps_done
            self.slider.value = step
        self.status.value = describe_step(self.engine, self.views["lockstep"].model, step)

    def _slider_moved(self, change) -> None:
        if not self._syncing:
            self.show_step(change["new"])

    def _rank_changed(self, change) -> None:
        if not self._syncing and "blocks" in self.views:
            self.views["blocks"].show_rank(change["new"])

    # ------------------------------------------------------------ animation
    def _play_toggled(self, change) -> None:
        if change["new"]:
            self._task = asyncio.ensure_future(self._play())
        else:
            self.pause()

    async def _play(self) -> None:
        try:
            while self.step(self.speed.value):
                await asyncio.sleep(0.05)
        finally:
            self.play_button.value = False

    def pause(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._task = None
