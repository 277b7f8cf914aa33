"""HiSparse: sparse decode from a host KV pool (DSA models, e.g. DeepSeek-V3.2).

DeepSeek-V3.2's attention reads only the top-k tokens (2,048) its indexer selects for
each query. The indexer itself needs only small keys (128 fp8 dims per token and
layer); the selected tokens' latents are ~5x larger. HiSparse keeps the *indexer keys*
of every token on the GPU and the *latents* in host memory, with a per-request GPU
buffer of recently used blocks: each step, the blocks holding the selected tokens that
the buffer lacks cross PCIe before attention runs. GPU memory then bounds the context
by its indexer keys, not its latents — many more long requests fit — at the price of
those copies.

What the indexer selects is modelled, not computed (the sim has no tensors): per
request, the most recent `LOCAL_SHARE` of k tokens, the first block (attention sink),
and a set of *hot* blocks from the rest of the context, a share `CHURN` of which is
replaced each step by blocks drawn at random (seeded per request) — attention's
temporal locality, not its content. A prefill chunk streams its cached prefix from
host once. Hits, misses and bytes moved are counted; the copies add to each rank's
step time (one PCIe link per GPU, not overlapped with compute).

Capacity (`hisparse_blocks`): blocks of the host pool (`hisparse_host_gib` per GPU,
default 80 % of the node's host memory shared by its GPUs), bounded by the GPU memory
the indexer keys of those blocks and every running request's buffer take.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from labkit.engine.step_io import Release
from labkit.errors import ConfigError
from labkit.specs.models import INDEXER_SCALE_BYTES

LOCAL_SHARE = 0.5  # of the top-k tokens: the most recent ones
SINK_BLOCKS = 1
CHURN = 0.05  # share of the hot blocks replaced at each step
HOST_SHARE = 0.8  # default host pool: this share of the node's host memory
GIB = 2**30


@dataclass(slots=True)
class HiSparseStats:
    selected_blocks: int = 0
    hit_blocks: int = 0
    loaded_blocks: int = 0  # misses: host -> GPU
    prefill_streamed_blocks: int = 0
    bytes_moved: float = 0.0
    load_s: float = 0.0


def index_bytes_per_token_per_gpu(placement) -> float:
    m = placement.model
    return placement._kv_layers_per_gpu() * (m.index_head_dim + INDEXER_SCALE_BYTES) \
        / placement.layout.dcp


def latent_bytes_per_token_per_gpu(placement) -> float:
    return placement.kv_bytes_per_token_per_gpu() - index_bytes_per_token_per_gpu(placement)


def check_hisparse(model, config, backend: str) -> None:
    if not config.hisparse_buffer_tokens:
        return
    if not model.has_indexer:
        raise ConfigError(f"hisparse_buffer_tokens needs a model with a sparse indexer "
                          f"(e.g. deepseek-v3.2); {model.name} attends densely")
    if backend != "sim":
        raise ConfigError("hisparse_buffer_tokens is modelled on the sim plane only")
    if config.hisparse_buffer_tokens < model.index_topk:
        raise ConfigError(f"hisparse_buffer_tokens={config.hisparse_buffer_tokens} cannot "
                          f"hold one step's selection ({model.index_topk} tokens, "
                          f"{model.name}'s index_topk)")


def hisparse_blocks(placement, hardware, config, block_size: int, available: float) -> int:
    """KV blocks per DP rank under HiSparse (see the module docstring)."""
    host = (config.hisparse_host_gib * GIB if config.hisparse_host_gib
            else HOST_SHARE * hardware.host_memory_bytes / hardware.gpus_per_node)
    host_blocks = int(host // (block_size * latent_bytes_per_token_per_gpu(placement)))
    buffers = config.max_num_seqs * config.hisparse_buffer_tokens * \
        latent_bytes_per_token_per_gpu(placement)
    gpu_blocks = int((available - buffers)
                     // (block_size * index_bytes_per_token_per_gpu(placement)))
    blocks = min(host_blocks, gpu_blocks)
    if blocks < 1:
        raise ConfigError(f"hisparse: {config.max_num_seqs} buffers of "
                          f"{config.hisparse_buffer_tokens} tokens leave no GPU memory for "
                          f"indexer keys; lower max_num_seqs or hisparse_buffer_tokens")
    return blocks


class HiSparse:
    """Per-request GPU buffers and the selection model; costs a step's copies."""

    def __init__(self, placement, hardware, block_layout, block_size: int,
                 buffer_tokens: int, seed: int) -> None:
        m = placement.model
        self.block_size = block_size
        self.topk_blocks = math.ceil(m.index_topk / block_size)
        self.local_blocks = math.ceil(m.index_topk * LOCAL_SHARE / block_size)
        self.hot_count = max(0, self.topk_blocks - self.local_blocks - SINK_BLOCKS)
        self.buffer_blocks = buffer_tokens // block_size
        self.block_bytes = block_size * latent_bytes_per_token_per_gpu(placement)
        self.hardware, self.layout, self.seed = hardware, block_layout, seed
        self.buffers: dict[str, OrderedDict] = {}
        self.hot: dict[str, np.ndarray] = {}
        self.rngs: dict[str, np.random.Generator] = {}
        self.stats = HiSparseStats()

    def release(self, request_id: str) -> None:
        for table in (self.buffers, self.hot, self.rngs):
            table.pop(request_id, None)

    # ------------------------------------------------------------- selection
    def _rng(self, request_id: str) -> np.random.Generator:
        if request_id not in self.rngs:
            digest = hashlib.blake2b(f"{self.seed}:{request_id}".encode(), digest_size=8)
            self.rngs[request_id] = np.random.default_rng(int.from_bytes(digest.digest(),
                                                                         "little"))
        return self.rngs[request_id]

    def select(self, request_id: str, num_blocks: int) -> list[int]:
        """Logical blocks the indexer picks this step for a context of num_blocks."""
        if num_blocks <= self.topk_blocks:
            return list(range(num_blocks))
        local = range(num_blocks - self.local_blocks, num_blocks)
        middle = num_blocks - self.local_blocks - SINK_BLOCKS  # candidates for hot blocks
        rng = self._rng(request_id)
        hot = self.hot.get(request_id)
        if hot is None or len(hot) != self.hot_count:
            hot = rng.choice(middle, size=min(self.hot_count, middle), replace=False)
        else:
            hot = hot[hot < middle]
            churn = max(1, round(CHURN * len(hot)))
            keep = rng.permutation(len(hot))[churn:]
            fresh = rng.choice(middle, size=self.hot_count - len(keep), replace=False)
            hot = np.unique(np.concatenate([hot[keep], fresh]))
        self.hot[request_id] = hot
        return [0, *(int(b) + SINK_BLOCKS for b in hot), *local]

    def _decode_misses(self, request_id: str, context: int) -> int:
        wanted = self.select(request_id, math.ceil((context + 1) / self.block_size))
        buf = self.buffers.setdefault(request_id, OrderedDict())
        misses = 0
        for b in wanted:
            if b in buf:
                buf.move_to_end(b)
            else:
                misses += 1
                buf[b] = None
        while len(buf) > self.buffer_blocks:
            buf.popitem(last=False)
        self.stats.selected_blocks += len(wanted)
        self.stats.hit_blocks += len(wanted) - misses
        return misses

    # ------------------------------------------------------------------ cost
    def rank_seconds(self, rank_step) -> float:
        """The PCIe copies one rank's step (`step_io.RankStep`) needs before its
        attention can run."""
        blocks = 0
        for rid, ctx, decode in zip(rank_step.request_ids, rank_step.contexts,
                                    rank_step.is_decode):
            if decode:
                blocks += self._decode_misses(rid, ctx)
            elif ctx:
                streamed = math.ceil(ctx / self.block_size)
                self.stats.prefill_streamed_blocks += streamed
                blocks += streamed
        if not blocks:
            return 0.0
        self.stats.loaded_blocks += blocks
        nbytes = blocks * self.block_bytes
        seconds = self.hardware.host_link_latency_s + nbytes / self.hardware.pcie_bandwidth \
            + self.layout.copy_overhead_s(blocks)
        self.stats.bytes_moved += nbytes
        self.stats.load_s += seconds
        return seconds

    def summary(self) -> dict:
        s = self.stats
        decode_loads = s.loaded_blocks - s.prefill_streamed_blocks
        return {"hisparse_selected_blocks": s.selected_blocks,
                "hisparse_hit_rate": s.hit_blocks / s.selected_blocks if s.selected_blocks
                else 0.0,
                "hisparse_decode_loaded_blocks": decode_loads,
                "hisparse_prefill_streamed_blocks": s.prefill_streamed_blocks,
                "hisparse_bytes_moved": s.bytes_moved, "hisparse_load_s": s.load_s}


class HiSparseDataPlane:
    """The sim data plane with HiSparse's copies added to each rank's step."""

    computes = False
    supports_runs = False  # each step's selection is drawn as it runs

    def __init__(self, inner, hisparse: HiSparse) -> None:
        self.inner, self.hisparse = inner, hisparse
        self.cost_model = inner.cost_model

    @property
    def min_step_s(self) -> float:
        return self.inner.min_step_s

    def execute(self, step):
        self._release(step.finished_ids)  # (before the step: a finished call is gone)
        out = self.inner.execute(step)
        timing = out.timing
        extra = np.array([self.hisparse.rank_seconds(r) for r in step.ranks])
        timing.busy[0] += extra
        timing.compute[0] += extra
        timing.duration[0] = timing.busy[0].max()  # the slowest rank (lockstep or alone)
        return out

    def apply(self, commands: list) -> None:
        self._release(c.request_id for c in commands if isinstance(c, Release))
        self.inner.apply(commands)

    def _release(self, request_ids) -> None:
        """Finished calls' buffers go (the `Release` commands the engine sends)."""
        for rid in request_ids:
            self.hisparse.release(rid)

    def close(self) -> None:
        self.inner.close()
