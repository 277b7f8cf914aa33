"""RankKVView: how full each DP rank's KV cache is, persistent vs temporary.

Per GPU of each DP rank: the KV its requests' blocks hold (persistent), the KV a layer
gathers or receives only while it runs (temporary: PCPxDCP's gathered copy, KVPP's
broadcast layer, DCP's gathered prefix), against the KV capacity the layout left it.
Bars show the state after a given step; the data comes from `StepsCompleted`.
"""

from __future__ import annotations

from labkit.engine.events import StepsCompleted
from labkit.widgets.base import EngineView, EventModel

GIB = 1 << 30


class RankKVModel(EventModel):
    def __init__(self, engine) -> None:
        self.ranks = [r for inst in engine.instances for r in inst.ranks]
        self.capacity = {r: inst.kv_total[i] * inst.kv_bytes_per_block
                         for inst in engine.instances for i, r in enumerate(inst.ranks)}
        self.history: dict[int, list[tuple[int, float, float]]] = {r: [] for r in self.ranks}
        super().__init__(engine)

    def on_event(self, event) -> None:
        if not isinstance(event, StepsCompleted):
            return
        for j in range(len(event.step_index)):
            seq = self.steps_done + j + 1
            for i, rank in enumerate(event.ranks):
                self.history[rank].append((seq, float(event.persistent_kv_bytes[j, i]),
                                           float(event.temporary_kv_bytes[j, i])))

    def state(self, upto_step: int | None = None) -> dict:
        """Per rank: (persistent, temporary, capacity) bytes per GPU after that step."""
        out = {}
        for rank in self.ranks:
            rows = [h for h in self.history[rank] if upto_step is None or h[0] <= upto_step]
            persistent, temporary = (rows[-1][1], rows[-1][2]) if rows else (0.0, 0.0)
            out[rank] = {"persistent": persistent, "temporary": temporary,
                         "capacity": float(self.capacity[rank])}
        return out


class RankKVView(EngineView):
    def __init__(self, engine) -> None:
        super().__init__(RankKVModel(engine))

    def make_figure(self):
        import plotly.graph_objects as go

        fig = go.FigureWidget(layout=dict(
            barmode="stack", height=300, margin=dict(l=50, r=10, t=40, b=40),
            title="KV per GPU of each DP rank", xaxis_title="DP rank", yaxis_title="GiB"))
        fig.add_bar(name="persistent", marker_color="#54A24B", x=[], y=[])
        fig.add_bar(name="temporary", marker_color="#EECA3B", x=[], y=[])
        fig.add_scatter(name="capacity", mode="markers", marker_symbol="line-ew-open",
                        marker_size=40, marker_color="black", x=[], y=[])
        return fig

    def figure_data(self, upto_step=None) -> dict:
        return self.model.state(upto_step)

    def draw(self, data: dict) -> None:
        ranks = list(data)
        labels = [f"rank {r}" for r in ranks]
        for trace, key in zip(self.figure.data, ("persistent", "temporary", "capacity")):
            trace.x = labels
            trace.y = [data[r][key] / GIB for r in ranks]
