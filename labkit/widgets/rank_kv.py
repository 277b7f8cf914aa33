"""RankKVView: the KV each GPU holds, persistent vs temporary, on a readable scale.

A DP rank's KV lives on all GPUs of its replica (tp x pcp x pp of them). What one GPU
holds of it depends on the layout: under TP with MLA every GPU keeps the whole latent;
under DCP each keeps one shard of the tokens (1/dcp); under PP a stage keeps its
layers. `StepsCompleted` reports per DP rank what *each* of its GPUs holds —
persistent (the requests' blocks) and temporary (KV a layer gathers or receives only
while it runs: PCPxDCP's gathered copy, KVPP's broadcast layer, DCP's gathered
prefix) — and the view draws one bar per GPU, grouped by DP rank, so TP4 (4 GPUs, each
with everything) and TP8xDCP2 (8 GPUs, each with half) look as different as they are.

The axis is GiB scaled to the data (a few GiB of a 100 GiB pool stay visible); the
right axis reads the same bars as % of the GPU's KV capacity, which the title states.
`model.frame()` is the history, one row per step per rank.
"""

from __future__ import annotations

import bisect

from labkit.engine.events import StepsCompleted
from labkit.widgets.base import EngineView, EventModel, empty_state, new_figure

GIB = 1 << 30


class RankKVModel(EventModel):
    def __init__(self, engine) -> None:
        self.ranks = [r for inst in engine.instances for r in inst.ranks]
        self.gpus_per_rank = engine.layout.gpus_per_replica
        self.dcp = engine.layout.dcp
        self.capacity = {r: inst.kv_total[i] * inst.kv_bytes_per_block
                         for inst in engine.instances for i, r in enumerate(inst.ranks)}
        # per rank: (step number, end time, persistent bytes, temporary bytes) per GPU
        self.history: dict[int, list[tuple[int, float, float, float]]] = \
            {r: [] for r in self.ranks}
        super().__init__(engine)

    def on_event(self, event) -> None:
        if not isinstance(event, StepsCompleted):
            return
        ends = (event.start + event.duration).tolist()
        for j, end in enumerate(ends):
            seq = self.steps_done + j + 1
            for i, rank in enumerate(event.ranks):
                self.history[rank].append((seq, end, float(event.persistent_kv_bytes[j, i]),
                                           float(event.temporary_kv_bytes[j, i])))

    def state(self, upto_step: int | None = None) -> dict:
        """Per DP rank: (persistent, temporary, capacity) bytes on each of its GPUs
        after that step."""
        out = {}
        for rank in self.ranks:
            rows = self.history[rank]
            n = len(rows) if upto_step is None else bisect.bisect_right(rows, (upto_step, 1e300))
            persistent, temporary = (rows[n - 1][2], rows[n - 1][3]) if n else (0.0, 0.0)
            out[rank] = {"persistent": persistent, "temporary": temporary,
                         "capacity": float(self.capacity[rank])}
        return out

    def per_gpu(self, upto_step: int | None = None) -> dict:
        """One entry per GPU: its DP rank, its place in the replica, its bytes."""
        state = self.state(upto_step)
        out = {"gpu": [], "dp_rank": [], "local": [], "persistent": [], "temporary": [],
               "capacity": []}
        for rank in self.ranks:
            for j in range(self.gpus_per_rank):
                out["gpu"].append(rank * self.gpus_per_rank + j)
                out["dp_rank"].append(rank)
                out["local"].append(j)
                for key in ("persistent", "temporary", "capacity"):
                    out[key].append(state[rank][key])
        return out

    def frame(self, upto_step: int | None = None):
        """KV per GPU of each DP rank after every step (pandas; bytes, seconds)."""
        import pandas as pd

        rows = [(seq, end, rank, p, t, self.capacity[rank])
                for rank in self.ranks for seq, end, p, t in self.history[rank]
                if upto_step is None or seq <= upto_step]
        return pd.DataFrame(rows, columns=["seq", "end_s", "dp_rank", "persistent_kv_bytes",
                                           "temporary_kv_bytes", "capacity_bytes"]
                            ).sort_values(["seq", "dp_rank"], ignore_index=True)


class RankKVView(EngineView):
    def __init__(self, engine) -> None:
        super().__init__(RankKVModel(engine))

    def make_figure(self):
        fig = new_figure(
            340, barmode="stack", title="KV per GPU",
            xaxis=dict(title="GPU (grouped by DP rank)"),
            yaxis=dict(title="KV per GPU (GiB)", rangemode="tozero"),
            yaxis2=dict(title="% of KV capacity", overlaying="y", side="right",
                        showgrid=False, rangemode="tozero"))
        fig.add_bar(name="persistent", marker_color="#54A24B", x=[], y=[],
                    hovertemplate="%{x}: %{y:.3g} GiB (%{customdata:.2f} % of capacity)"
                                  "<extra>persistent</extra>")
        fig.add_bar(name="temporary (while a layer runs)", marker_color="#EECA3B", x=[], y=[],
                    hovertemplate="%{x}: %{y:.3g} GiB<extra>temporary</extra>")
        # an invisible twin on the right axis, so that axis is drawn with its scale
        fig.add_scatter(x=[], y=[], yaxis="y2", showlegend=False, hoverinfo="skip",
                        mode="markers", marker=dict(opacity=0))
        return fig

    def figure_data(self, upto_step=None) -> dict:
        return self.model.per_gpu(upto_step)

    def draw(self, data: dict) -> None:
        persistent, temporary, twin = self.figure.data
        if not data["gpu"]:
            empty_state(self.figure, "no GPU")
            return
        empty_state(self.figure, None)
        labels = [[f"DP rank {r}" for r in data["dp_rank"]], [f"GPU {g}" for g in data["gpu"]]]
        used = [(p + t) / GIB for p, t in zip(data["persistent"], data["temporary"])]
        capacity = max(data["capacity"]) / GIB
        top = max(max(used) * 1.25, min(1.0, capacity))  # at least 1 GiB of scale
        persistent.x = temporary.x = labels
        persistent.y = [p / GIB for p in data["persistent"]]
        persistent.customdata = [100 * p / c if c else 0.0
                                 for p, c in zip(data["persistent"], data["capacity"])]
        temporary.y = [t / GIB for t in data["temporary"]]
        twin.x, twin.y = [labels[0][:1], labels[1][:1]], [0]
        self.figure.layout.yaxis.update(range=[0, top], autorange=False)
        self.figure.layout.yaxis2.update(range=[0, 100 * top / capacity if capacity else 100],
                                         autorange=False)
        shard = f"; each keeps 1/{self.model.dcp} of the tokens (DCP)" \
            if self.model.dcp > 1 else ""
        self.figure.layout.title.text = (
            f"KV per GPU (GiB, capacity {capacity:.1f} GiB per GPU)<br><sup>"
            f"{self.model.gpus_per_rank} GPU(s) per DP rank{shard}</sup>")
