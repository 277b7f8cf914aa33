"""PrefixCacheView: how much of each prompt the cache served, and the hit rate so far.

Each admitted call shows as a bar of its prompt: the tokens served from the prefix
cache (or adopted from its parent, or fetched from another rank) and the tokens it had
to compute. Above, the token-weighted hit rate over time. Data: `RequestScheduled`
(a call's first admission; re-admissions after preemption do not count twice).
"""

from __future__ import annotations

from labkit.engine.events import RequestScheduled
from labkit.widgets.base import EngineView, EventModel


class PrefixCacheModel(EventModel):
    kinds = (RequestScheduled,)

    def __init__(self, engine) -> None:
        self.calls: list[tuple[int, float, str, int, int]] = []  # seq, t, id, cached, prompt
        self._seen: set[str] = set()
        super().__init__(engine)

    def on_event(self, event) -> None:
        if isinstance(event, RequestScheduled) and event.request_id not in self._seen:
            self._seen.add(event.request_id)
            self.calls.append((self.steps_done + 1, event.t, event.request_id,
                               event.num_cached_tokens, event.num_prompt_tokens))

    def state(self, upto_step: int | None = None, last: int = 30) -> dict:
        calls = [c for c in self.calls if upto_step is None or c[0] <= upto_step]
        times, rates, cached_sum, prompt_sum = [], [], 0, 0
        for _, t, _, cached, prompt in calls:
            cached_sum += cached
            prompt_sum += prompt
            times.append(t)
            rates.append(cached_sum / prompt_sum)
        recent = calls[-last:]
        return {"t": times, "hit_rate": rates,
                "requests": [c[2] for c in recent],
                "cached": [c[3] for c in recent],
                "computed": [c[4] - c[3] for c in recent]}


class PrefixCacheView(EngineView):
    def __init__(self, engine, last: int = 30) -> None:
        self.last = last
        super().__init__(PrefixCacheModel(engine))

    def make_figure(self):
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        fig = go.FigureWidget(make_subplots(rows=2, cols=1, vertical_spacing=0.18,
                                            subplot_titles=("prefix-cache hit rate so far",
                                                            "tokens of recent calls")))
        fig.add_scatter(name="hit rate", mode="lines", x=[], y=[], row=1, col=1)
        fig.add_bar(name="cached", marker_color="#54A24B", x=[], y=[], row=2, col=1)
        fig.add_bar(name="computed", marker_color="#E45756", x=[], y=[], row=2, col=1)
        fig.update_layout(barmode="stack", height=420, margin=dict(l=50, r=10, t=40, b=40))
        fig.update_yaxes(range=[0, 1], row=1, col=1)
        return fig

    def figure_data(self, upto_step=None) -> dict:
        return self.model.state(upto_step, self.last)

    def draw(self, data: dict) -> None:
        line, cached, computed = self.figure.data
        line.x, line.y = data["t"], data["hit_rate"]
        cached.x, cached.y = data["requests"], data["cached"]
        computed.x, computed.y = data["requests"], data["computed"]
