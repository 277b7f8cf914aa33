"""PrefixCacheView: how much of each prompt the cache served, and the hit rate so far.

Each admitted call shows as a bar of its prompt: the tokens served from the prefix
cache (or adopted from its parent, or fetched from another rank) and the tokens it had
to compute. Above, the token-weighted hit rate over time. Data: `RequestScheduled`
(a call's first admission; re-admissions after preemption do not count twice).
`model.frame()` is one row per admitted call.
"""

from __future__ import annotations

from labkit.engine.events import RequestScheduled
from labkit.widgets.base import EngineView, EventModel, empty_state


class PrefixCacheModel(EventModel):
    kinds = (RequestScheduled,)

    def __init__(self, engine) -> None:
        # (t, tag, rank, request id, cached tokens, prompt tokens), in admission order
        self.calls: list[tuple[float, int, int, str, int, int]] = []
        self._seen: set[str] = set()
        super().__init__(engine)

    def on_event(self, event) -> None:
        if isinstance(event, RequestScheduled) and event.request_id not in self._seen:
            self._seen.add(event.request_id)
            self.calls.append((event.t, self.steps_done + 1, event.rank, event.request_id,
                               event.num_cached_tokens, event.num_prompt_tokens))

    def admitted(self, upto_step: int | None = None) -> list[tuple]:
        """The calls admitted by the end of step `upto_step` (all so far if None)."""
        if upto_step is None:
            return self.calls
        return [c for c in self.calls
                if self.clock.includes(c[0], c[1], False, self.clock.last_step(c[2], upto_step))]

    def state(self, upto_step: int | None = None, last: int = 30) -> dict:
        calls = self.admitted(upto_step)
        times, rates, cached_sum, prompt_sum = [], [], 0, 0
        for t, _, _, _, cached, prompt in calls:
            cached_sum += cached
            prompt_sum += prompt
            times.append(t)
            rates.append(cached_sum / prompt_sum)
        recent = calls[-last:]
        first = len(calls) - len(recent)
        return {"t": times, "hit_rate": rates,
                "call": list(range(first + 1, len(calls) + 1)),
                "requests": [c[3] for c in recent],
                "cached": [c[4] for c in recent],
                "computed": [c[5] - c[4] for c in recent]}

    def frame(self, upto_step: int | None = None):
        import pandas as pd

        return pd.DataFrame(
            [(t, rank, rid, cached, prompt) for t, _, rank, rid, cached, prompt
             in self.admitted(upto_step)],
            columns=["admitted_s", "dp_rank", "request_id", "cached_tokens", "prompt_tokens"])


class PrefixCacheView(EngineView):
    def __init__(self, engine, last: int = 30) -> None:
        self.last = last
        super().__init__(PrefixCacheModel(engine))

    def make_figure(self):
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        fig = go.Figure(make_subplots(
            rows=2, cols=1, vertical_spacing=0.28,
            subplot_titles=("prefix-cache hit rate so far (token-weighted)",
                            f"prompt tokens of the last {self.last} calls admitted")))
        fig.add_scatter(name="hit rate", mode="lines", x=[], y=[], row=1, col=1,
                        showlegend=False, hovertemplate="t = %{x:.1f} s: %{y:.1f} %")
        fig.add_bar(name="from the cache", marker_color="#54A24B", x=[], y=[], row=2, col=1)
        fig.add_bar(name="computed", marker_color="#E45756", x=[], y=[], row=2, col=1)
        fig.update_layout(barmode="stack", height=480, autosize=True, template="plotly_white",
                          margin=dict(l=70, r=20, t=60, b=50),
                          legend=dict(orientation="h", yanchor="top", y=-0.16, x=1.0,
                                      xanchor="right"))
        fig.update_xaxes(title_text="time (s)", row=1, col=1)
        fig.update_yaxes(title_text="hit rate (%)", range=[0, 100], row=1, col=1)
        fig.update_xaxes(title_text="call (in admission order)", row=2, col=1)
        fig.update_yaxes(title_text="tokens", row=2, col=1)
        return fig

    def figure_data(self, upto_step=None) -> dict:
        return self.model.state(upto_step, self.last)

    def draw(self, data: dict) -> None:
        line, cached, computed = self.figure.data
        if not data["t"]:
            line.x = line.y = cached.x = cached.y = computed.x = computed.y = []
            empty_state(self.figure, "no call admitted yet")
            return
        empty_state(self.figure, None)
        line.x, line.y = data["t"], [100 * r for r in data["hit_rate"]]
        for bar, key in ((cached, "cached"), (computed, "computed")):
            bar.x, bar.y = data["call"], data[key]
            bar.customdata = data["requests"]
            bar.hovertemplate = "call %{x} (%{customdata}): %{y} tokens"
