"""Executors: where the GPU ranks of the compute plane live and how work reaches them.

The compute data plane never touches a rank's tensors directly during a step. It asks
its executor to run a *rank operation* — a plain module-level function `op(rank, *args)`
such as `forward_step` — on a list of GPUs, one argument tuple each, and gets their
results back in that order:

- `ThreadExecutor` (`executor="threads"`, the default): every rank is an object of
  this process and runs on a thread of a `VirtualCluster`; a notebook can inspect any
  rank's tensors.
- `ProcessExecutor` (`executor="mp"`, mp_executor.py): one process per GPU, collectives
  over torch.distributed; each step's operation and arguments are the one message the
  driver sends to the workers.

Because operations are module-level functions over picklable arguments (a `StepBatch`,
block ids, request ids), the same call crosses a thread or a process boundary. A rank
is built from a `RankPlan`: what every process needs to rebuild its own rank (model,
layout, pool size, weights source) without the control plane.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from labkit.engine.compute.group import Group, VirtualCluster
from labkit.engine.compute.mesh import Mesh, RankPlace
from labkit.engine.compute.models.checkpoint import READS, CheckpointReader, load_safetensors
from labkit.engine.compute.models.weights import init_weights
from labkit.engine.compute.paged_kv import PagedKV
from labkit.engine.compute.rank import Rank
from labkit.engine.compute.rank_model import rank_forward
from labkit.engine.compute.rank_weights import kv_shapes, rank_weights
from labkit.engine.compute.step_batch import StepBatch
from labkit.engine.compute.weight_source import DictSource, SeededSource
from labkit.errors import ConfigError, unknown_choice

EXECUTORS = ("threads", "mp")
GROUP_KINDS = ("tp", "pcp", "dcp", "ep", "pp")


def check_executor(executor: str) -> str:
    if executor not in EXECUTORS:
        raise unknown_choice("executor", executor, EXECUTORS)
    return executor


@dataclass(slots=True)
class RankPlan:
    """Everything a process needs to build its GPU's rank (picklable)."""

    spec: object  # ModelSpec
    layout: object  # Layout
    config: object  # EngineConfig
    num_blocks: int
    block_size: int
    device: torch.device
    dtype: torch.dtype
    checkpoint: object = None  # a safetensors file or folder
    weights: dict | None = None  # full weights given directly (shipped to the workers)

    def full_weights(self) -> dict:
        """The whole model (the threads executor's ranks all cut from it)."""
        if self.weights is not None:
            return self.weights
        if self.checkpoint:
            return load_safetensors(self.checkpoint, self.spec, dtype=self.dtype)
        return init_weights(self.spec, self.config.seed, self.dtype)

    def check(self) -> None:
        """Before any process starts: a checkpoint's names, shapes and config.json
        agree with the model (headers only; raises CheckpointError)."""
        if self.weights is None and self.checkpoint:
            CheckpointReader(self.checkpoint, self.spec, self.dtype)

    def source(self):
        """Where a process reads its own GPU's tensors from, without the rest of the
        model: the given weights, the checkpoint read piece by piece, or seeds made
        tensor by tensor (weight_source.py)."""
        if self.weights is not None:
            return DictSource(self.weights)
        if self.checkpoint:  # checked by the driver (`check`) before the workers start
            return CheckpointReader(self.checkpoint, self.spec, self.dtype, verify=False)
        return SeededSource(self.spec, self.config.seed, self.dtype)

    def build(self, place: RankPlace, mesh: Mesh, source,
              groups: dict[str, Group]) -> Rank:
        """GPU `place`'s rank, its weights read from `source` (a weight source or the
        full weights)."""
        w = rank_weights(self.spec, source, place, self.layout, self.device)
        kv = PagedKV(kv_shapes(self.spec, w), self.num_blocks, self.block_size,
                     self.layout.dcp, place.dcp_index if self.layout.dcp > 1 else 0,
                     self.config.dcp_kv_cache_interleave_size, self.dtype, self.device)
        return Rank(place, mesh, w, kv, groups)


# -------------------------------------------------------------- rank operations
def forward_step(rank: Rank, batch: StepBatch, copies: list) -> tuple:
    """Apply the replica's copy-on-write pairs, then run the step's forward pass:
    `(seconds, seconds in collectives, the last stage's (rows, logits) or None)`."""
    for pairs in copies:
        rank.kv.copy_blocks(pairs)
    before = comm_seconds(rank)
    start = time.perf_counter()
    out = rank_forward(rank, batch)
    return time.perf_counter() - start, comm_seconds(rank) - before, out


def comm_seconds(rank: Rank) -> float:
    groups = {id(g): g for g in (rank.tp, rank.pcp, rank.dcp, rank.ep, rank.pp)}
    return sum(g.comm_s for g in groups.values())


def kv_nbytes(rank: Rank) -> int:
    return rank.kv.nbytes


def read_kv_block(rank: Rank, block: int) -> dict[str, torch.Tensor]:
    """A copy, on the CPU, of what this GPU holds of paged block `block`: every layer's
    cache tensors, named `"<layer>.<name>"` (the offload tiers' bytes)."""
    return {f"{layer}.{name}": t[block].detach().to("cpu", copy=True)
            for layer, named in rank.kv.layers.items() for name, t in named.items()}


def write_kv_block(rank: Rank, block: int, data: dict[str, torch.Tensor]) -> None:
    """Put `read_kv_block`'s bytes back into paged block `block`."""
    for layer, named in rank.kv.layers.items():
        for name, t in named.items():
            src = data[f"{layer}.{name}"]
            t[block].copy_(src, non_blocking=src.is_pinned())


def checkpoint_reads(rank: Rank) -> tuple[int, list[str]]:
    """What this GPU's process has read from checkpoints: (bytes, sorted names)."""
    return READS.bytes, sorted(READS.names)


def weight_nbytes(rank: Rank) -> int:
    """The bytes of the weights this GPU holds (its slices)."""
    return sum(t.numel() * t.element_size() for named in rank.weights.values()
               for t in named.values())


def release_request(rank: Rank, request_id: str) -> None:
    rank.linear.release(request_id)


def restore_snapshot(rank: Rank, key: int, request_id: str, position: int) -> None:
    if rank.snapshots.layers:
        rank.snapshots.restore(key, request_id, position)


def save_snapshot(rank: Rank, key: int, request_id: str, position: int,
                  dropped: frozenset) -> None:
    """Copy the linear state; drop copies of snapshots the control plane evicted."""
    if rank.snapshots.layers:
        rank.snapshots.save(key, request_id, position)
        rank.snapshots.prune(lambda k: k not in dropped)


# ------------------------------------------------------------------- threads
class ThreadExecutor:
    """All ranks in this process, one thread each during a step."""

    name = "threads"

    def __init__(self, plan: RankPlan, mesh: Mesh, full: dict) -> None:
        self.mesh = mesh
        self.cluster = VirtualCluster(mesh.world_size)
        self.ranks = [plan.build(place, mesh, full, self._groups(place))
                      for place in mesh.places]

    def _groups(self, place: RankPlace) -> dict[str, Group]:
        return {kind: self.cluster.group(getattr(place, f"{kind}_group"), place.gpu)
                for kind in GROUP_KINDS}

    def run(self, op, args_per_gpu: list[tuple], gpus: list[int]) -> list:
        ranks = self.ranks
        return self.cluster.run(lambda gpu, *args: op(ranks[gpu], *args), args_per_gpu, gpus)

    def copy_kv(self, pairs: list[tuple[int, int]], src_blocks, dst_blocks) -> None:
        """Blocks of GPU gs's paged KV into GPU gd's, for each (gs, gd)."""
        for gs, gd in pairs:
            self.ranks[gd].kv.copy_from(self.ranks[gs].kv, src_blocks, dst_blocks)

    def close(self) -> None:
        """Stop the threads and let the ranks go (their tensors are freed now, not when
        the engine holding this is collected)."""
        self.cluster.close()
        self.ranks.clear()


def make_executor(executor: str, plan: RankPlan, mesh: Mesh):
    check_executor(executor)
    if executor == "threads":
        return ThreadExecutor(plan, mesh, plan.full_weights())
    from labkit.engine.compute.mp_executor import ProcessExecutor
    return ProcessExecutor(plan, mesh)


class RemoteRanks:
    """`plane.ranks` under executor='mp': the driver's own rank, and a clear error for
    the ranks that live in worker processes."""

    def __init__(self, local: dict[int, Rank], world_size: int) -> None:
        self._local, self._n = local, world_size

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, gpu: int) -> Rank:
        if gpu in self._local:
            return self._local[gpu]
        raise ConfigError(f"executor='mp': GPU {gpu}'s tensors live in its worker process; "
                          "inspect ranks with executor='threads'")

    def __iter__(self):
        return (self[g] for g in range(self._n))
