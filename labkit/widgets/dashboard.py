"""Dashboard: the four views over one engine, with the knobs people turn.

Pick a layout (TP, DCP, PCP, DEP or DP and a degree — or type any layout string),
`long_prefill_token_threshold`, `prefill_schedule_interval` and the router; *rebuild*
makes a fresh engine with them and replays the trace into fresh views. Play / pause
drive the engine a few steps per tick without blocking the notebook (an asyncio task
on the kernel's loop), *step* advances one step, *speed* sets steps per tick. Once the
run is over, the step slider shows any moment of it again.

Everything the dashboard does is also a method (`rebuild`, `step`, `run`, `show_step`),
so a notebook, a test or a headless browser can drive it the same way.
"""

from __future__ import annotations

import asyncio

import ipywidgets as widgets

from labkit.engine.engine import Engine
from labkit.errors import ConfigError
from labkit.specs.config import ROUTER_POLICIES
from labkit.widgets.block_table import BlockTableView
from labkit.widgets.lockstep import LockstepView
from labkit.widgets.prefix_cache import PrefixCacheView
from labkit.widgets.rank_kv import RankKVView

LAYOUT_KINDS = ("TP", "DCP", "PCP", "DEP", "DP")
DEGREES = (1, 2, 4, 8, 16)


def layout_string(kind: str, degree: int, moe: bool) -> str:
    """The layout a (kind, degree) choice means: DCP rides on TP; PCP keeps DCP shards
    and, for MoE models, spreads the experts over its ranks."""
    if degree == 1:
        return "tp1"
    return {"TP": f"tp{degree}", "DCP": f"tp{degree}xdcp{degree}",
            "PCP": f"pcp{degree}xdcp{degree}" + (f"xep{degree}" if moe else ""),
            "DEP": f"dep{degree}", "DP": f"dp{degree}"}[kind]


def layout_choice(layout: str) -> tuple[str, int]:
    """The (kind, degree) the dropdowns show for a layout string (TP 1 if none fits)."""
    for kind in LAYOUT_KINDS:
        for degree in DEGREES:
            for moe in (True, False):
                if layout_string(kind, degree, moe) == layout.strip().lower():
                    return kind, degree
    return "TP", 1


class Dashboard(widgets.VBox):
    def __init__(self, trace, model: str = "deepseek-v3", layout: str = "dep8",
                 hardware: str = "h200", concurrency: int = 8, duration_s: float = 300.0,
                 rank: int = 0, **knobs) -> None:
        super().__init__()
        self.trace, self.model_name, self.hardware = trace, model, hardware
        self.concurrency, self.duration_s, self.rank = concurrency, duration_s, rank
        self.knobs = dict(knobs)
        self.engine = None
        self.views: dict = {}
        self._task = None
        self._build_controls(layout)
        self.rebuild()

    # ------------------------------------------------------------- controls
    def _build_controls(self, layout: str) -> None:
        kind, degree = layout_choice(layout)
        self.kind = widgets.Dropdown(options=LAYOUT_KINDS, value=kind, description="layout")
        self.degree = widgets.Dropdown(options=DEGREES, value=degree, description="degree")
        self.layout_text = widgets.Text(value=layout, description="exact")
        self.threshold = widgets.BoundedIntText(
            value=self.knobs.pop("long_prefill_token_threshold", 0), min=0, max=1 << 20,
            description="threshold")
        self.interval = widgets.BoundedIntText(
            value=self.knobs.pop("prefill_schedule_interval", 1), min=1, max=1024,
            description="interval")
        self.router = widgets.Dropdown(options=ROUTER_POLICIES,
                                       value=self.knobs.pop("router", "session_sticky"),
                                       description="router")
        self.rebuild_button = widgets.Button(description="rebuild", icon="refresh")
        self.play_button = widgets.ToggleButton(description="play", icon="play")
        self.step_button = widgets.Button(description="step", icon="step-forward")
        self.speed = widgets.IntSlider(value=5, min=1, max=200, description="steps/tick")
        self.slider = widgets.IntSlider(value=0, min=0, max=0, description="show step",
                                        continuous_update=False)
        self.status = widgets.HTML()
        for w in (self.kind, self.degree):
            w.observe(self._kind_changed, names="value")
        self.rebuild_button.on_click(lambda _: self.rebuild())
        self.step_button.on_click(lambda _: self.step())
        self.play_button.observe(self._play_toggled, names="value")
        self.slider.observe(lambda ch: self.show_step(ch["new"]), names="value")

    def _kind_changed(self, _change) -> None:
        moe = self.engine.model.is_moe if self.engine else True
        self.layout_text.value = layout_string(self.kind.value, self.degree.value, moe)

    # -------------------------------------------------------------- engine
    def rebuild(self) -> None:
        """A fresh engine with the chosen knobs, a fresh replay, fresh views."""
        self.pause()
        for view in self.views.values():
            view.detach()
        knobs = dict(self.knobs, long_prefill_token_threshold=self.threshold.value,
                     prefill_schedule_interval=self.interval.value, router=self.router.value)
        try:
            engine = Engine(model=self.model_name, layout=self.layout_text.value.strip(),
                            hardware=self.hardware, **knobs)
        except ConfigError as err:
            self.status.value = f"<b style='color:#c00'>cannot build: {err}</b>"
            return
        self.engine = engine
        self.run_handle = engine.start_replay(self.trace, concurrency=self.concurrency,
                                              duration_s=self.duration_s,
                                              start_part_way=False)
        rank = min(self.rank, engine.layout.num_dp_ranks - 1)
        self.views = {"blocks": BlockTableView(engine, rank), "prefix": PrefixCacheView(engine),
                      "lockstep": LockstepView(engine), "kv": RankKVView(engine)}
        controls = widgets.VBox([
            widgets.HBox([self.kind, self.degree, self.layout_text]),
            widgets.HBox([self.threshold, self.interval, self.router, self.rebuild_button]),
            widgets.HBox([self.play_button, self.step_button, self.speed]),
            widgets.HBox([self.slider, self.status]),
        ])
        figures = [v.figure for v in self.views.values()]
        self.children = [controls, widgets.HBox(figures[:2]), widgets.HBox(figures[2:])]
        self._update_status()

    def step(self, n: int = 1) -> bool:
        """Advance n engine steps (fast-forwarded runs count as one); False when over."""
        alive = True
        for _ in range(n):
            alive = self.engine.step()
            if not alive:
                break
        for view in self.views.values():
            view.flush()
        self._update_status()
        return alive

    def run(self) -> None:
        """Run to the end of the replay (no animation)."""
        while self.engine.step():
            pass
        for view in self.views.values():
            view.flush()
        self._update_status()

    def show_step(self, step: int) -> None:
        """Show every view as it was after `step` steps."""
        for view in self.views.values():
            view.show_step(None if step >= self._steps_done() else step)

    def _steps_done(self) -> int:
        return next(iter(self.views.values())).model.steps_done if self.views else 0

    def _update_status(self) -> None:
        done = self._steps_done()
        self.slider.max = done
        self.slider.value = done
        e = self.engine
        finished = sum(r.finished for r in e.requests.values())
        self.status.value = (f"{e.layout.text} on {e.gpus} x {e.hardware.name}: "
                             f"t = {e.now:.1f} s, {done} steps, {finished} calls done")

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
