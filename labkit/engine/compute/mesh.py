"""Where each GPU rank sits in a layout, and which ranks it talks to.

A layout (`labkit.specs.Layout`) numbers its GPUs replica by replica, stage by stage:

    gpu = ((dp_index * pp + stage) * pcp + pcp_index) * tp + tp_index

and every collective of a step runs inside one of these groups:

- **tp**: same replica, stage and PCP index — splits heads and matrices.
- **pcp**: same replica, stage and TP index — each member takes its own query tokens and
  all-gathers the new KV of the others.
- **dcp**: members that would otherwise hold *the same* KV (the same KV heads, or MLA's
  single latent) shard it by token instead. Among a replica-stage's tp*pcp GPUs, those
  holding the same heads form a class (ordered by PCP index, then TP index), cut into
  consecutive groups of `dcp` — for `tp4xdcp2` on MLA: {0, 1} and {2, 3}, as vLLM does;
  for `tp2xpcp2xdcp2` on a 2-KV-head GQA model: the two PCP copies of each head.
- **ep**: consecutive groups of `ep` GPUs of one stage across replicas (DEP spans them
  all), holding whole experts; expert e lives on member `e // (E / ep)`.
- **pp**: same replica and (pcp, tp) position, one per stage — passes hidden states on.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.specs.layout import Layout
from labkit.specs.models import ModelSpec


@dataclass(frozen=True, slots=True)
class RankPlace:
    """One GPU's coordinates and the global ranks of each of its groups."""

    gpu: int
    dp: int
    stage: int
    pcp_index: int
    tp_index: int
    tp_group: tuple[int, ...]
    pcp_group: tuple[int, ...]
    dcp_group: tuple[int, ...]
    ep_group: tuple[int, ...]
    pp_group: tuple[int, ...]
    layers: range  # this stage's decoder layers

    @property
    def dcp_index(self) -> int:
        return self.dcp_group.index(self.gpu)

    @property
    def ep_index(self) -> int:
        return self.ep_group.index(self.gpu)

    @property
    def first_stage(self) -> bool:
        return self.stage == 0

    @property
    def last_stage(self) -> bool:
        return self.stage == len(self.pp_group) - 1


class Mesh:
    def __init__(self, layout: Layout, spec: ModelSpec) -> None:
        self.layout, self.spec = layout, spec
        lo = layout
        self.gpus_per_replica = lo.pp * lo.pcp * lo.tp
        self.world_size = lo.dp * self.gpus_per_replica
        self._stage_layers = _split_layers(spec.num_layers, lo.pp)
        self.places = [self._place(g) for g in range(self.world_size)]

    def gpu(self, dp: int, stage: int, pcp_index: int, tp_index: int) -> int:
        lo = self.layout
        return ((dp * lo.pp + stage) * lo.pcp + pcp_index) * lo.tp + tp_index

    def replica_gpus(self, dp: int) -> list[int]:
        start = dp * self.gpus_per_replica
        return list(range(start, start + self.gpus_per_replica))

    def heads_class(self, tp_index: int) -> int:
        """GPUs of a TP group with equal class hold the same KV (see module docstring)."""
        if self.spec.is_mla:
            return 0
        kv = self.spec.num_kv_heads
        return tp_index if self.layout.tp <= kv else tp_index // (self.layout.tp // kv)

    # ---------------------------------------------------------------- internals
    def _place(self, g: int) -> RankPlace:
        lo = self.layout
        tp_index = g % lo.tp
        pcp_index = g // lo.tp % lo.pcp
        stage = g // (lo.tp * lo.pcp) % lo.pp
        dp = g // self.gpus_per_replica
        tp_group = tuple(self.gpu(dp, stage, pcp_index, t) for t in range(lo.tp))
        pcp_group = tuple(self.gpu(dp, stage, c, tp_index) for c in range(lo.pcp))
        pp_group = tuple(self.gpu(dp, s, pcp_index, tp_index) for s in range(lo.pp))
        same_kv = [self.gpu(dp, stage, c, t) for c in range(lo.pcp) for t in range(lo.tp)
                   if self.heads_class(t) == self.heads_class(tp_index)]
        i = same_kv.index(g) // lo.dcp * lo.dcp
        dcp_group = tuple(same_kv[i:i + lo.dcp])
        stage_gpus = [self.gpu(d, stage, c, t) for d in range(lo.dp) for c in range(lo.pcp)
                      for t in range(lo.tp)]
        j = stage_gpus.index(g) // lo.ep * lo.ep
        ep_group = tuple(stage_gpus[j:j + lo.ep])
        return RankPlace(g, dp, stage, pcp_index, tp_index, tp_group, pcp_group, dcp_group,
                         ep_group, pp_group, self._stage_layers[stage])


def _split_layers(num_layers: int, stages: int) -> list[range]:
    """Contiguous, as even as possible; earlier stages take the extra layers."""
    base, extra = divmod(num_layers, stages)
    out, start = [], 0
    for s in range(stages):
        n = base + (s < extra)
        out.append(range(start, start + n))
        start += n
    return out
