"""Which part of a request's KV each GPU holds, GPU by GPU.

`engine/layouts.py` (Placement) says *how much* KV a GPU of a layout keeps; the compute
plane (`engine/compute/mesh.py`, `paged_kv.py`) says *which*: GPUs are numbered replica
by replica, stage by stage, `gpu = ((dp * pp + stage) * pcp + pcp_index) * tp + tp_index`,
and a GPU of DP rank d holds, of every request d runs:

- **layers**: its pipeline stage's decoder layers (contiguous, earlier stages take the
  extra ones). Under KVPP the layers are dealt round-robin over the GPUs that would
  otherwise hold the same KV: member m of such a group owns layers l with
  `l % kvpp == m`, and receives each other layer only while it runs (temporary).
- **heads**: GQA KV heads are split over TP (`kv_heads / tp` each); past tp = kv_heads
  each head is replicated on `tp / kv_heads` GPUs. MLA keeps one latent per token
  that serves all heads, so every TP rank holds it (head 0).

Layers and heads are `Indices` (a printable range).
- **positions**: all of them, unless DCP shards them. The GPUs that would hold the same
  KV (same heads, any PCP index) are cut into groups of `dcp`; member s keeps the
  positions p with `(p // interleave) % dcp == s` (`dcp_kv_cache_interleave_size`).
  PCP splits a prefill's *queries*, not the KV: the new KV is all-gathered, so every
  PCP rank keeps all of it unless DCP shards it.

Temporary KV, held only while one layer of a step runs (the same rules as the step
model's `_temporary_kv`): PCPxDCP gathers the full KV of each prefill request for its
queries; DCP alone on an MLA model (no sparse indexer) gathers a prefill chunk's cached
prefix; KVPP broadcasts the owner's layer to the others.

The queries a GPU computes in a step: its PCP rank's two chunks of each request's new
tokens (cut into 2·pcp chunks, rank r takes r and 2·pcp-1-r, as `step_batch.py`), or
all of them without PCP.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from labkit.engine.compute.mesh import Mesh
from labkit.engine.layouts import Placement


@dataclass(frozen=True, slots=True, order=True)
class Indices:
    """Layer or head indices start, start + step, ... below stop. Prints as `0-60`, or
    `3-59 every 8`; `i in indices` and `indices.range` work as with a range."""

    start: int
    stop: int
    step: int = 1

    @classmethod
    def of(cls, r: range) -> Indices:
        return cls(r.start, r.stop, r.step)

    @property
    def range(self) -> range:
        return range(self.start, self.stop, self.step)

    def __contains__(self, i: int) -> bool:
        return i in self.range

    def __str__(self) -> str:
        r = self.range
        if len(r) <= 1:
            return str(r[0]) if len(r) else "-"
        return f"{r[0]}-{r[-1]}" + (f" every {r.step}" if r.step > 1 else "")


@dataclass(frozen=True, slots=True)
class GPUKV:
    """What one GPU keeps of each request of its DP rank."""

    gpu: int
    dp_rank: int
    stage: int
    tp_index: int
    pcp_index: int
    layers: Indices  # layers whose KV it keeps
    heads: Indices  # KV heads it keeps (MLA: head 0, the latent)
    shards: int  # DCP: positions p with (p // interleave) % shards == shard
    shard: int
    borrowed: tuple[Indices, ...] = ()  # KVPP: layers it receives while they run
    multi_stage: bool = False  # PP: say which layers in the label

    @property
    def label(self) -> str:
        """E.g. `GPU 3 · dp0 · head 1 · shard 3/8` (what tells it from its neighbours)."""
        parts = [f"GPU {self.gpu}", f"dp{self.dp_rank}"]
        if self.multi_stage or self.layers.step > 1:
            parts.append(f"layers {self.layers}")
        parts.append(f"head {self.heads}" if len(self.heads.range) == 1
                     else f"heads {self.heads}")
        if self.shards > 1:
            parts.append(f"shard {self.shard}/{self.shards}")
        return " · ".join(parts)


def gpu_kv(placement: Placement) -> list[GPUKV]:
    """Every GPU of the layout, in GPU order."""
    model, lay = placement.model, placement.layout
    mesh = Mesh(lay, model)
    out = []
    for place in mesh.places:
        heads = _heads(model, lay.tp, place.tp_index)
        layers, borrowed = place.layers, ()
        if lay.kvpp > 1:
            same = [t for t in range(lay.tp)
                    if mesh.heads_class(t) == mesh.heads_class(place.tp_index)]
            owner = same.index(place.tp_index) % lay.kvpp
            layers = _residue(place.layers, lay.kvpp, owner)
            borrowed = tuple(_residue(place.layers, lay.kvpp, m)
                             for m in range(lay.kvpp) if m != owner)
        out.append(GPUKV(place.gpu, place.dp, place.stage, place.tp_index, place.pcp_index,
                         Indices.of(layers), Indices.of(heads), lay.dcp,
                         place.dcp_index if lay.dcp > 1 else 0,
                         tuple(Indices.of(b) for b in borrowed if len(b)), lay.pp > 1))
    return out


def _heads(model, tp: int, tp_index: int) -> range:
    if model.is_mla:
        return range(0, 1)
    kv = model.num_kv_heads
    if tp <= kv:
        per = kv // tp
        return range(tp_index * per, (tp_index + 1) * per)
    head = tp_index // (tp // kv)
    return range(head, head + 1)


def _residue(layers: range, k: int, m: int) -> range:
    """The layers l of a contiguous range with l % k == m."""
    first = layers.start + (m - layers.start) % k
    return range(first, max(first, layers.stop), k)


def query_chunks(start: int, num_new: int, pcp: int, pcp_index: int) -> list[tuple[int, int]]:
    """Positions of the new tokens whose queries PCP rank `pcp_index` computes."""
    if pcp == 1:
        return [(start, start + num_new)] if num_new else []
    bounds = np.linspace(0, num_new, 2 * pcp + 1).round().astype(np.int64)
    out = []
    for chunk in sorted((pcp_index, 2 * pcp - 1 - pcp_index)):
        a, b = int(bounds[chunk]), int(bounds[chunk + 1])
        if b > a:
            out.append((start + a, start + b))
    return out


def temporary_tokens(placement: Placement, context: int, num_new: int,
                     decode: bool) -> int:
    """How many leading positions of a request a GPU of its replica gathers for a
    layer of a step (0: none), by the step model's rules."""
    lay = placement.layout
    if num_new == 0:
        return 0
    if lay.pcp > 1 and lay.dcp > 1:
        return 0 if decode else context + num_new  # the full KV, for this rank's queries
    if placement.gathers_prefix_for_prefill():
        return 0 if decode else context  # the cached prefix of a prefill chunk
    if lay.kvpp > 1:
        return context + num_new  # the context, broadcast layer by layer
    return 0


def temporary_layers(placement: Placement, gpu: GPUKV) -> tuple[Indices, ...]:
    """The layers a GPU holds gathered KV of, one at a time: KVPP's borrowed layers,
    otherwise its own (the gathered copy of the layer being computed)."""
    return gpu.borrowed if placement.layout.kvpp > 1 else (gpu.layers,)
