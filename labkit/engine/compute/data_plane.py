"""The compute data plane: the scheduler's batches run on real tensors.

Where the simulated plane asks a cost model how long a step takes, this one runs it.
Each GPU of the layout is a `Rank` (its weight slices, its paged KV, linear-attention
states) and a step is SPMD: every GPU of the stepping replicas runs `rank_forward` on
its own thread of a `VirtualCluster` (`executor="threads"`) or in its own process
(`executor="mp"`, see executors.py), talking to its peers only through collectives.
Then, on the host:

- **sampling**: greedy (argmax, lowest id on ties) from the last stage's logits;
- **speculative verify**: a decoding request's `1 + k` rows are its last token and k
  n-gram drafts; drafts are accepted while they match the argmax before them, plus
  the model's own next token — exactly plain greedy's tokens, fewer steps;
- **the clock**: `clock="measured"` (default) makes a step last as long as it took
  (per replica: its slowest GPU; time inside collectives counts as communication);
  `clock="predicted"` runs the tensors but keeps the cost model's durations, so a
  compute replay schedules exactly like the simulated one of the same cluster.

Everything a step needs arrives in its message (`engine/step_io.py`): each request's
new token ids, block table, window table, state marks and copy-on-write pairs, and the
commands the control plane queued since the last step (a session's KV fetched from
another DP rank, copied block by block; linear-state snapshots saved and restored;
finished requests released, blocks moved to and from the offload tiers, a P/D
hand-over's KV read out or written in), which `apply` carries out, in order, before
the forward.
The plane never reads the control plane's objects.

Sliding-window models (gpt-oss): a step's entries carry a second block table, the KV
manager's `window_table` (pages of the sliding layers, -1 once a block left the
window); the attention of those layers writes and reads through it (`attention`).
Every layer's paged cache is indexed by the same block ids, one page per logical block.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from labkit.engine.compute.executors import (
    RankPlan, check_executor, forward_step, kv_nbytes, make_executor, release_request,
    restore_snapshot, save_snapshot)
from labkit.engine.compute.kv_convert import export_request, export_snapshot, import_request, \
    import_state
from labkit.engine.compute.kv_namespace import kv_identity, weights_identity
from labkit.engine.compute.mesh import Mesh
from labkit.engine.compute.models.family import check_computable
from labkit.engine.compute.step_batch import Entry, StepBatch
from labkit.engine.compute.tier_bytes import TierBytes
from labkit.engine.step_io import CopyBlocks, ExportKV, FetchState, ImportKV, KVExported, \
    Release, RestoreState, SaveState, StepInput, StepOutput, TierMoves
from labkit.engine.step_work import StepTiming
from labkit.errors import ConfigError, unknown_choice

CLOCKS = ("measured", "predicted")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}
DEVICES = ("cpu", "cuda")
MEASURED_MIN_STEP_S = 1e-6


class ComputeDataPlane:
    computes = True
    supports_runs = False  # real kernels cannot cost a run of steps without running it

    def __init__(self, spec, layout, config, num_blocks: int, block_size: int, *,
                 device: str = "cpu", dtype: str = "float32",
                 clock: str = "measured", cost_model=None, checkpoint=None,
                 weights: dict | None = None, executor: str = "threads") -> None:
        """The paged caches hold `num_blocks` blocks of `block_size` tokens (the ids the
        KV manager hands out); `weights` (full, unsharded) or a safetensors `checkpoint`
        replace the seeded random weights; `executor` threads|mp: ranks as threads of this
        process or as processes over torch.distributed."""
        check_executor(executor)
        if clock not in CLOCKS:
            raise unknown_choice("clock", clock, CLOCKS)
        if clock == "predicted" and cost_model is None:
            raise ConfigError("clock='predicted' needs a cost model")
        self.spec, self.layout, self.config = spec, layout, config
        self.device = check_device(device)
        self.dtype = check_dtype(dtype)
        self.clock, self.cost_model = clock, cost_model
        self.block_size, self.num_blocks = block_size, num_blocks
        check_computable(spec)
        check_window_support(spec, layout)
        if layout.kvpp > 1:
            raise ConfigError(f"layout {layout.text!r}: the compute plane does not run kvpp yet")
        self.num_speculative_tokens = config.num_speculative_tokens
        self.mesh = Mesh(layout, spec)
        # what the weights are, for the disk tier's namespace (kv_namespace.py)
        self.weights_id = weights_identity(config.seed, checkpoint, weights) \
            if config.disk_kv_gib else ""
        plan = RankPlan(spec, layout, config, num_blocks, block_size, self.device, self.dtype,
                        checkpoint, weights)
        self.executor = make_executor(executor, plan, self.mesh)
        self.ranks = self.executor.ranks
        self.record_logits = False
        self.logits: list[tuple[str, np.ndarray, torch.Tensor]] = []  # when recording
        self.steps = 0
        # where the time goes (wall seconds): building inputs and sampling on the host,
        # the SPMD forward (the slowest GPU), the part of it spent in collectives
        self.seconds = {"host": 0.0, "forward": 0.0, "collectives": 0.0}
        self.accepted_drafts = 0
        self.proposed_drafts = 0
        # the offload tiers' bytes (host tensors, block files), when tiers are configured
        self.tiers = self._tier_bytes(config.kv_offload_dir) if config.cpu_kv_gib else None
        self.closed = False

    @property
    def min_step_s(self) -> float:
        return self.cost_model.min_step_s if self.clock == "predicted" else MEASURED_MIN_STEP_S

    @property
    def kv_bytes_per_gpu(self) -> int:
        gpus = list(range(self.mesh.world_size))
        return max(self.executor.run(kv_nbytes, [()] * len(gpus), gpus))

    # ------------------------------------------------------------------ step
    def execute(self, step: StepInput) -> StepOutput:
        self._check_open()
        t0 = time.perf_counter()
        reports = self.apply(step.commands)
        batches = step.ranks
        copies = {b.rank: [] for b in batches}  # copy-on-write pairs, applied on the ranks
        steps = {b.rank: self._step_batch(b, copies[b.rank]) for b in batches}
        gpus = [g for b in batches for g in self.mesh.replica_gpus(b.rank)]
        t1 = time.perf_counter()
        dps = [self.mesh.places[g].dp for g in gpus]
        results = self.executor.run(forward_step, [(steps[d], copies[d]) for d in dps], gpus)
        t2 = time.perf_counter()
        elapsed = dict(zip(gpus, (r[0] for r in results)))
        comm = dict(zip(gpus, (r[1] for r in results)))
        logits = self._collect(gpus, [r[2] for r in results])
        tokens = {}
        for b in batches:
            tokens.update(self._sample(steps[b.rank], logits.get(b.rank, {})))
        self.steps += 1
        timing = self._timing(step, gpus, elapsed, comm, t2 - t1)
        self.seconds["forward"] += t2 - t1
        self.seconds["collectives"] += max(comm.values())
        self.seconds["host"] += (t1 - t0) + (time.perf_counter() - t2)
        return StepOutput(timing, tokens, reports)

    def _step_batch(self, b, copies: list) -> StepBatch:
        """One DP rank's part of the message (`RankStep`) as the tensors' view of it;
        its copy-on-write pairs go to `copies` (the ranks apply them before the step)."""
        entries, token_ids = [], []
        for i, rid in enumerate(b.request_ids):
            if b.copies[i]:  # copy-on-write: the request's private copy of a shared block
                copies.append(list(b.copies[i]))
            entries.append(Entry(rid, b.contexts[i], b.num_new_tokens[i], b.is_decode[i],
                                 b.block_tables[i], b.samples[i],
                                 window_table=b.window_tables[i],
                                 state_marks=b.state_marks[i]))
            token_ids.extend(b.token_ids[i])
        return StepBatch(entries, token_ids, self.block_size, self.layout.pcp, self.device)

    def _collect(self, gpus, outs) -> dict[int, dict[int, torch.Tensor]]:
        """Logits by replica and token row, from the last stage's first TP rank(s)."""
        by_replica: dict[int, dict[int, torch.Tensor]] = {}
        for g, out in zip(gpus, outs):
            place = self.mesh.places[g]
            if out is None or place.tp_index != 0:
                continue
            rows, logits = out
            mine = by_replica.setdefault(place.dp, {})
            for r, row in zip(rows.tolist(), logits):
                mine[r] = row
        return by_replica

    def _sample(self, batch: StepBatch, logits: dict[int, torch.Tensor]) -> dict[str, list]:
        tokens = {}
        for e in batch.entries:
            if not (e.decode or e.samples):
                continue
            rows = range(e.start, e.start + e.num_new) if e.decode else [e.start + e.num_new - 1]
            best = [int(torch.argmax(logits[r])) for r in rows]
            if self.record_logits:
                self.logits.append((e.request_id, batch.positions[list(rows)],
                                    torch.stack([logits[r] for r in rows]).cpu()))
            if not e.decode:
                tokens[e.request_id] = best[:1]
                continue
            drafts = batch.token_ids[e.start + 1:e.start + e.num_new].tolist()
            produced = [best[0]]
            for j, d in enumerate(drafts):
                if d != best[j]:
                    break
                produced.append(best[j + 1])
            self.proposed_drafts += len(drafts)
            self.accepted_drafts += len(produced) - 1
            tokens[e.request_id] = produced
        return tokens

    # ----------------------------------------------------------------- clock
    def _timing(self, step: StepInput, gpus, elapsed, comm_s, wall) -> StepTiming:
        batches, lockstep = step.ranks, step.lockstep
        if self.clock == "predicted":
            return self.cost_model.step_timing(step.work, lockstep)
        busy = np.zeros((1, len(batches)))
        comm = np.zeros((1, len(batches)))
        for i, b in enumerate(batches):
            replica = self.mesh.replica_gpus(b.rank)
            busy[0, i] = max(elapsed[g] for g in replica)
            comm[0, i] = max(comm_s[g] for g in replica)
        duration = np.array([wall if lockstep else busy.max()])
        return StepTiming(busy, np.maximum(busy - comm, 0), comm, duration,
                          np.zeros((1, len(batches))))

    # ------------------------------------------------------------- commands
    def apply(self, commands: list) -> list:
        """Carry out the control plane's commands, in the order it decided them;
        returns their reports (the offload tiers' `DiskWrite`s)."""
        reports = []
        for c in commands:
            if isinstance(c, CopyBlocks):
                self.copy_kv(c.src_dp, c.dst_dp, c.src_blocks, c.dst_blocks)
            elif isinstance(c, SaveState):
                self._save_linear_state(c)
            elif isinstance(c, RestoreState):
                gpus = self.mesh.replica_gpus(c.dp)
                args = (c.key, c.request_id, c.position)
                self.executor.run(restore_snapshot, [args] * len(gpus), gpus)
            elif isinstance(c, FetchState):  # (its KV came in the CopyBlocks before it)
                data = export_snapshot(self, c.src_dp, c.key, c.position)
                import_state(self, c.dst_dp, c.request_id, c.position, data)
            elif isinstance(c, Release):
                self.release(c.request_id)
            elif isinstance(c, TierMoves):
                reports += self.tiers(c.store, c.moves)
            elif isinstance(c, ExportKV):  # P/D: the bytes go back in the report
                reports.append(KVExported(c.transfer, export_request(self, c)))
            elif isinstance(c, ImportKV):
                import_request(self, c)
            else:
                raise ValueError(f"unknown data-plane command {c!r}")
        return reports

    def _save_linear_state(self, c: SaveState) -> None:
        """The control plane saved a snapshot: copy the state on DP rank dp's GPUs, and
        drop the copies of snapshots it has evicted since."""
        gpus = self.mesh.replica_gpus(c.dp)
        args = (c.key, c.request_id, c.position, frozenset(c.dropped))
        self.executor.run(save_snapshot, [args] * len(gpus), gpus)

    # ------------------------------------------------------------ inspection
    def request_kv(self, dp: int, table, num_tokens: int, layer: int, gpu: int,
                   window_table=None) -> tuple[np.ndarray, dict]:
        """What GPU `gpu` holds in `layer` of a request's KV on DP rank `dp`, whose first
        `num_tokens` tokens sit in the blocks `table` (for a sliding-window layer: in
        `window_table`, -1 where a block left the window): the positions it owns (all of
        them, or its DCP shard) and, per cache tensor, their entries. The control plane
        says which blocks (`Engine.request_kv` asks its KV manager)."""
        place = self.mesh.places[gpu]
        if dp != place.dp:
            raise ValueError(f"the request runs on DP rank {dp}; GPU {gpu} "
                             f"belongs to DP rank {place.dp}")
        if layer not in self.ranks[gpu].kv.layers:
            raise ValueError(f"GPU {gpu} holds no paged KV of layer {layer} (its layers: "
                             f"{sorted(self.ranks[gpu].kv.layers)})")
        kv = self.ranks[gpu].kv
        positions = np.nonzero(kv.owned(np.arange(num_tokens)))[0]
        if self.spec.is_sliding_layer(layer):  # (no DCP: positions are local indices)
            table = window_table if window_table is not None else np.zeros(0, np.int32)
            positions = positions[positions < len(table) * self.block_size]
            positions = positions[table[positions // self.block_size] >= 0]
        entries = {name: kv.gather_at(layer, name, table, kv.local_index(positions))
                   for name in kv.layers[layer]}
        return positions, entries

    # ------------------------------------------------------------ bytes
    def copy_kv(self, src_dp: int, dst_dp: int, src_blocks, dst_blocks) -> None:
        """A session's prefix KV, fetched from DP rank src_dp's GPUs to dst_dp's."""
        pairs = list(zip(self.mesh.replica_gpus(src_dp), self.mesh.replica_gpus(dst_dp)))
        self.executor.copy_kv(pairs, src_blocks, dst_blocks)

    def _tier_bytes(self, directory: str | None) -> TierBytes:
        """The KV offload tiers' bytes, kept in step with the control plane's tier
        moves; closed with the plane."""
        identity = kv_identity(self.spec, self.layout, self.dtype, self.config.kv_dtype(),
                               self.block_size, self.device, self.weights_id)
        return TierBytes(self, directory, identity, self.config.kv_offload_strict)

    def release(self, request_id: str) -> None:
        if self.spec.linear_layers:  # (only linear-attention layers keep per-request state)
            gpus = list(range(self.mesh.world_size))
            self.executor.run(release_request, [(request_id,)] * len(gpus), gpus)

    def close(self) -> None:
        """Stop the executor (its ranks' tensors are let go, its processes stopped) and
        the offload tiers; once only."""
        if self.closed:
            return
        self.closed = True
        self.executor.close()
        if self.tiers is not None:
            self.tiers.close()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this engine was closed (Engine.close()): its ranks are gone; "
                               "make a new engine to run more steps")


def check_window_support(spec, layout) -> None:
    """Sliding-window layers run here as GQA over unsharded positions: no MLA, no DCP."""
    if spec.sliding_window_layers and (spec.is_mla or layout.dcp > 1):
        raise ConfigError(f"{spec.name}: the compute plane runs sliding-window layers as "
                          "GQA without DCP (a DCP shard's positions are not the window's); "
                          f"got attention={spec.attention!r}, dcp={layout.dcp}")


def check_kv_memory(device: str, bytes_per_gpu: float, gpus: int) -> None:
    """Refuse paged caches that cannot be allocated: on a CPU every GPU's cache lives in
    this machine's memory; on CUDA each in its device's memory."""
    if str(device).startswith("cuda") and torch.cuda.is_available():
        need, have = bytes_per_gpu, torch.cuda.get_device_properties(0).total_memory
        where = "a CUDA device's"
    else:
        need = bytes_per_gpu * gpus
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        where = "this machine's"
    if need > have:
        raise ConfigError(f"num_gpu_blocks_override: the paged KV caches would take "
                          f"{need / 2**30:,.1f} GiB, more than {where} {have / 2**30:,.1f} GiB")


def check_device(device: str) -> torch.device:
    kind = str(device).split(":")[0]
    if kind not in DEVICES:
        raise unknown_choice("device", device, DEVICES)
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but torch sees no CUDA GPU here; use device='cpu'")
    return torch.device(device)


def check_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise unknown_choice("dtype", dtype, DTYPES)
    return DTYPES[dtype]
