"""Compare: one trace on several layouts, the same views on one time axis.

Is DCP8 better than DEP8 for this workload? Replay the same trace, with the same
concurrency and knobs, on each layout, and look at them together:

- a **summary table** of each layout's headline metrics (`summary()`, a DataFrame);
- one **timeline** figure whose rows share the time axis (zoom one, all follow): each
  layout's lockstep heatmap (DP ranks x time, colour = stall share), then KV per GPU
  and the prefix-cache hit rate over time, one line per layout;
- the **pictures** — every view of `dashboard.VIEWS` that is not a time series (the
  block tables, and any view that joins the list), one per layout, stacked.

`step(seconds)` moves the shared clock and every engine with it; `run()` plays all to
the end; `show_time(t)` shows everything as it was at time t. All figure data is
available as DataFrames (`frames()`).

    Compare(trace, layouts=["tp8", "tp8xdcp8", "dep8"], model="deepseek-v3",
            concurrency=8, duration_s=60)
"""

from __future__ import annotations

import html

import ipywidgets as widgets
import numpy as np
import pandas as pd

from labkit.engine.engine import Engine
from labkit.errors import ConfigError
from labkit.widgets.base import FigureOutput, refresh_soon
from labkit.widgets.dashboard import FULL_WIDTH, VIEWS, view_grid
from labkit.widgets.lockstep import LockstepModel
from labkit.widgets.prefix_cache import PrefixCacheModel
from labkit.widgets.rank_kv import RankKVModel
from labkit.widgets.timeline import draw_timeline, kv_over_time, timeline_figure

TIME_SERIES = ("lockstep", "kv", "prefix")  # drawn on the shared timeline instead
SUMMARY = {  # column: (summary key, scale)
    "gpus": ("gpus", 1), "calls done": ("requests_completed", 1),
    "throughput (tok/s/GPU)": ("throughput_tok_s_per_gpu", 1),
    "TTFT p50 (s)": ("ttft_p50_s", 1), "TPOT p50 (ms)": ("tpot_p50_s", 1e3),
    "prefix hit rate": ("prefix_cache_hit_rate", 1), "stall share": ("stall_share", 1),
    "peak KV use": ("kv_cache_usage_peak", 1),
}


class Compare(widgets.VBox):
    def __init__(self, trace, layouts, model: str = "deepseek-v3", hardware: str = "h200",
                 concurrency: int = 8, duration_s: float = 60.0, bins: int = 240,
                 **knobs) -> None:
        super().__init__(layout=FULL_WIDTH)
        if len(layouts) < 2:
            raise ConfigError(f"Compare needs two or more layouts; got {list(layouts)}")
        self.layouts = list(layouts)
        self.duration_s, self.bins = float(duration_s), bins
        self.engines, self.runs = {}, {}
        for layout in self.layouts:  # every refusal before anything runs
            try:
                engine = Engine(model=model, layout=layout, hardware=hardware, **knobs)
                self.runs[layout] = engine.start_replay(
                    trace, concurrency=concurrency, duration_s=duration_s,
                    start_part_way=False)
            except ConfigError as err:
                raise ConfigError(f"layout {layout!r}: {err}") from None
            self.engines[layout] = engine
        self.lockstep = {k: LockstepModel(e) for k, e in self.engines.items()}
        self.kv = {k: RankKVModel(e) for k, e in self.engines.items()}
        self.prefix = {k: PrefixCacheModel(e) for k, e in self.engines.items()}
        self.pictures = {k: {name: make(e, 0) for name, make in VIEWS.items()
                             if name not in TIME_SERIES}
                         for k, e in self.engines.items()}
        self.time_s = 0.0
        self.timeline = timeline_figure(self.layouts,
                                        {k: m.ranks for k, m in self.lockstep.items()})
        self.timeline_widget = FigureOutput()
        self._build_widgets()
        self.show_time(0.0)

    def _build_widgets(self) -> None:
        self.step_button = widgets.Button(description="step", icon="step-forward")
        self.run_button = widgets.Button(description="run to the end", icon="fast-forward")
        self.seconds = widgets.BoundedFloatText(
            value=max(self.duration_s / 20, 1.0), min=0.01, max=1e6,
            description="seconds per step", style={"description_width": "initial"},
            layout=widgets.Layout(width="16em"))
        self.status = widgets.HTML(layout=FULL_WIDTH)
        self.table = widgets.HTML(layout=FULL_WIDTH)
        self.step_button.on_click(lambda _: self.step())
        self.run_button.on_click(lambda _: self.run())
        pictures = [widgets.VBox([widgets.HTML(f"<b>{html.escape(layout)}</b>"), view.widget],
                                 layout=FULL_WIDTH)
                    for layout, views in self.pictures.items() for view in views.values()]
        self.children = [
            widgets.HBox([self.step_button, self.seconds, self.run_button],
                         layout=widgets.Layout(flex_flow="row wrap")),
            self.status, self.table,
            self.timeline_widget, view_grid(pictures)]

    def _repr_mimebundle_(self, **kwargs):
        refresh_soon([self.timeline_widget] + [v.widget for views in self.pictures.values()
                                               for v in views.values()])
        return super()._repr_mimebundle_(**kwargs)

    # ------------------------------------------------------------- driving
    def step(self, seconds: float | None = None) -> bool:
        """Advance every engine `seconds` of simulated time (default: the box's
        value) and show that moment. False when every replay is over."""
        target = min(self.time_s + (seconds or self.seconds.value), self.duration_s)
        alive = False
        for engine in self.engines.values():
            while engine.now < target and engine.step():
                pass
            alive |= engine.has_events()
        self.show_time(target)
        return alive and target < self.duration_s

    def run(self) -> None:
        """Every replay to its end; show the end."""
        for engine in self.engines.values():
            while engine.step():
                pass
        self.show_time(self.duration_s)

    def show_time(self, t: float) -> None:
        """Show every figure as it was at time t (seconds)."""
        self.time_s = t
        draw_timeline(self.timeline, self.timeline_data(t))
        self.timeline_widget.show(self.timeline)
        for layout, views in self.pictures.items():
            step = self.lockstep[layout].steps_by(t)
            for view in views.values():
                view.show_step(step)
        self.table.value = self.summary().to_html(float_format=lambda v: f"{v:.3g}")
        self.status.value = (f"t = {t:.1f} s of {self.duration_s:.0f} s &middot; "
                             + " &middot; ".join(f"{html.escape(k)}: {m.steps_by(t)} steps"
                                                 for k, m in self.lockstep.items()))

    # ---------------------------------------------------------------- data
    def timeline_data(self, t: float | None = None) -> dict:
        """What the timeline draws up to time t: per layout its lockstep bins, KV per
        GPU (mean and max over DP ranks, bytes) and hit rate, on shared bin edges."""
        t = self.time_s if t is None else t
        window = (0.0, max(t, 1e-6))
        out = {}
        for layout in self.layouts:
            grid = self.lockstep[layout].binned(None, self.bins, window)
            prefix = self.prefix[layout].state()
            keep = [i for i, s in enumerate(prefix["t"]) if s <= t]
            out[layout] = {"lockstep": grid,
                           "kv": kv_over_time(self.kv[layout].frame(), grid["edges"]),
                           "hit_t": [prefix["t"][i] for i in keep],
                           "hit_rate": [prefix["hit_rate"][i] for i in keep]}
        return out

    def summary(self) -> pd.DataFrame:
        """Each layout's headline metrics so far (rows: layouts)."""
        rows = {}
        for layout, run in self.runs.items():
            s = run.result().summary
            rows[layout] = {col: s.get(key, np.nan) * scale if s.get(key) is not None
                            else np.nan for col, (key, scale) in SUMMARY.items()}
        return pd.DataFrame.from_dict(rows, orient="index").rename_axis("layout")

    def frames(self) -> dict[str, pd.DataFrame]:
        """Every step of every rank, KV per step, admitted calls — each with a
        `layout` column — and the summary."""
        def stacked(models):
            return pd.concat([m.frame().assign(layout=k) for k, m in models.items()],
                             ignore_index=True)

        return {"summary": self.summary(), "lockstep": stacked(self.lockstep),
                "kv": stacked(self.kv), "prefix": stacked(self.prefix)}
