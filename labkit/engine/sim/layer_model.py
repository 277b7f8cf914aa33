"""The step model: one engine step, layer by layer, from calibrated kernels.

For each DP rank the model walks one pipeline stage's layers and adds up what a GPU
of that rank does, pricing every kernel with the calibrated `CostModel` ops:

- **attention layers** (`attention_cost.py`): the projections (GEMMs; MLA's
  down-projections and a DSA indexer replicated on every TP rank, the per-head parts
  split), then the attention core — decode over each request's context, prefill chunk
  by chunk over its prefix — and, for DeepSeek-V3.2, the indexer over the whole
  context plus a gather of the top-k entries. DCP shards the context a GPU reads but
  hands it every head's queries; PCP splits a chunk's queries and all-gathers its KV;
- **linear-attention layers** (KDA), **MLP / MoE**, the LM head and MTP drafts
  (`mlp_cost.py`): projections plus a recurrent state update; dense GEMMs, or the
  fused MoE kernel plus shared experts and router, the experts spread as the layout
  says; then the **sampler** over each sampled row's vocabulary (`sampler_cost.py`);
- **collectives**: whatever `Placement` says the layer communicates (TP all-reduce,
  EP all-to-all, DCP query gather and partial-output merge, PCP KV gather, KVPP
  broadcast), priced by the collective model;
- what the step costs beyond its kernels (`overheads.py`): CUDA-graph dispatch — the
  GEMMs see the batch padded up to its capture size — the CPU's scheduling, input
  preparation, launches and sampling, overlapped with the GPU under async scheduling,
  and the DP ranks' per-step coordination.

MoE layers under expert parallelism wait for their busiest rank: its share of the
routed rows comes from the routing distribution (`costmodel/routing.py`, the knob
`moe_routing`), EPLB's replicas included when `enable_eplb` is on (`mlp_cost.py`).

Pipeline parallelism: a GPU computes one stage. Steps whose batch only continues
prefills pipeline back to back (a stage's time each); a step that decodes needs the
previous step's sampled token, so it pays the whole pipeline (pp stages) plus the
activation hand-offs. Lockstep DP ranks (DEP) last as long as the slowest; an idle
rank runs a dummy batch (padded, with CUDA graphs, to the largest batch of the step).

Nothing here knows which layout "should" win: DCP's growing per-step cost, DEP's
stalls or PP's bubbles come out of these sums.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np

from labkit.engine.layouts import Placement
from labkit.engine.sim.attention_cost import AttentionCost
from labkit.engine.sim.compiled_rows import CompiledRows
from labkit.engine.sim.count_blocks import CountBlocks
from labkit.engine.sim.memo import ExactMemo, no_memo, same_rows
from labkit.engine.sim.mlp_cost import MlpCost, priced_collectives
from labkit.engine.sim.overheads import FITTED, OverheadParams, StepOverheads, capture_sizes
from labkit.engine.sim.sampler_cost import SamplerCost
from labkit.engine.step_work import StepTiming, StepWork
from labkit.specs.config import EngineConfig

# the counts of a StepWork that graph dispatch reads
_Counts = namedtuple("_Counts", "prefill_tokens decode_tokens num_prefill_reqs "
                                "num_decode_reqs idle")
# what a step's counts alone decide (one memo entry per step, `_count_pieces`):
# `terms` the stage's count-only compute and comm terms (`_count_terms`), `attn_comm`
# an attention layer's collectives (None when they read the contexts), `decoders`
# what the decode core needs (`AttentionCost.decoders`), `cpu` and
# `launch` the step's CPU time and graph launches (`overheads.py`)
_CountPieces = namedtuple("_CountPieces", "mode padded t_dec tokens proj terms attn_comm "
                                          "decoders extra cpu launch")


class LayerStepModel:
    def __init__(self, placement: Placement, ops, num_speculative_tokens: int = 0, *,
                 overheads: StepOverheads | None = None, moe_routing: str = "balanced",
                 seed: int = 0, memoize: bool = True, sampling: str = "top_p") -> None:
        """`overheads` None: kernels only (a bare forward pass). `memoize`: remember the
        pieces that depend only on token counts (`memo.py`; exact, same results).
        `sampling`: what the sampler does to each row (`sampler_cost.SAMPLINGS`)."""
        self.placement = placement
        self.ops = ops = ops.trusted()  # the sizes below are built here: no checks
        self.model = m = placement.model
        self.layout = lay = placement.layout
        self.drafts = num_speculative_tokens
        self.width = 1 + num_speculative_tokens
        self.attention = attn = AttentionCost(placement, ops, self.width)
        pp = lay.pp
        # layers of each kind on one pipeline stage (average stage)
        self.full_layers = m.num_full_attention_layers / pp
        self.window_layers = m.num_sliding_layers / pp
        self.linear_layers = m.num_linear_layers / pp
        self.moe_layers = m.num_moe_layers / pp
        self.dense_layers = m.num_dense_mlp_layers / pp
        self.mlp = MlpCost(placement, ops, attn.wdtype, num_speculative_tokens, moe_routing,
                           seed)
        self.sampler = SamplerCost(m.vocab_size, ops.hardware.hbm_bandwidth, sampling)
        self.overheads = overheads
        self.memo = ExactMemo() if memoize else no_memo
        # the layer kinds a stage sums besides full attention (a kind the model lacks
        # would add exact zeros: it is left out)
        self.kinds = tuple(k for k in ("moe", "dense", "linear")
                           if getattr(self, f"{k}_layers"))
        # an attention layer's collectives read the contexts only to broadcast them
        # (KVPP) or gather a prefill's cached prefix; otherwise its counts decide them
        p = placement
        self.comm_reads_context = lay.kvpp > 1 or p.gathers_prefix_for_prefill() \
            or p.gathers_shards_for_prefill()
        # one rank's steps priced in one compiled loop where that is this model's sum
        # (`compiled_rows.py`; it reads the memo's count pieces as numbers)
        self.compiled_rows = CompiledRows(self) if memoize and CompiledRows.applies(self) else None
        # the count pieces of steps with a prompt's chunk, priced a block of prefill
        # sizes at a time (`count_blocks.py`)
        self.count_blocks = CountBlocks(self) if memoize and CountBlocks.applies(self) \
            else None

    @classmethod
    def from_config(cls, placement: Placement, ops, config: EngineConfig,
                    params: OverheadParams = FITTED) -> LayerStepModel:
        """The step model an engine with these knobs runs: vLLM's graph dispatch, CPU
        overheads (priced with `params`, by default the fitted ones) and MoE routing."""
        lay = placement.layout
        q = config.tokens_per_decode_step
        sizes = capture_sizes(config.max_num_seqs, config.max_num_batched_tokens, q,
                              config.capture_sizes(), config.max_cudagraph_capture_size)
        layers = (placement.model.num_layers + placement.model.num_mtp_modules
                  * (config.num_speculative_tokens > 0)) / lay.pp
        overheads = StepOverheads(params, mode=config.cudagraph_mode, sizes=sizes,
                                  decode_query_len=q, max_num_seqs=config.max_num_seqs,
                                  async_scheduling=config.async_scheduling, layers=layers)
        return cls(placement, ops, config.num_speculative_tokens, overheads=overheads,
                   moe_routing=config.moe_routing, seed=config.seed,
                   memoize=config.sim_step_cache, sampling=config.sampling)

    @property
    def min_step_s(self) -> float:
        return self.overheads.min_step_s if self.overheads is not None else 1e-6

    @property
    def prices_chunk_rows(self) -> bool:
        """Are a run's rows priced as their steps alone when some carry prefill chunks
        and others do not? Not with DCP, PCP or KVPP: their collectives are included
        when any row of the array needs them (`Placement.comm_per_layer`), so rows
        without prefill would pay the prefill's (decode-only runs are unaffected)."""
        lay = self.layout
        return lay.dcp == 1 and lay.pcp == 1 and lay.kvpp == 1

    # ------------------------------------------------------------------ step
    def step_timing(self, work: StepWork, lockstep: bool) -> StepTiming:
        pp = self.layout.pp
        counts = self._counts(work, lockstep)
        if self.compiled_rows is not None and not lockstep and work.prefill_tokens.shape[1] == 1:
            timing = self.compiled_rows.timing(work, counts)
            if timing is not None:
                return timing
        fixed = self._piece("counts", self._count_pieces, lockstep, *counts)
        padded, extra = fixed.padded, fixed.extra
        stage_compute, stage_comm, tokens = self._stage(work, counts, lockstep, 1.0, padded,
                                                        fixed)
        if pp == 1:
            compute, comm = stage_compute + extra, stage_comm
        else:
            # A step that only continues prefills enters the pipeline behind the last
            # one: it costs one stage. A step that decodes needs the previous step's
            # sampled tokens: its batch goes through as M micro-batches (one per request,
            # at most pp), taking (M + pp - 1) micro-batch stage times, bubbles included.
            pipelined = counts.num_decode_reqs.sum(axis=1, keepdims=True) == 0
            micro = np.clip(counts.num_prefill_reqs + counts.num_decode_reqs, 1, pp)
            mb_padded = None if padded is None else padded / micro
            mb_compute, mb_comm, mb_tokens = self._stage(work, counts, lockstep, micro,
                                                         mb_padded)
            slots = micro + pp - 1
            hand_off = self.ops.p2p(self.placement.pp_p2p_bytes(tokens), "nvlink")
            mb_hand_off = self.ops.p2p(self.placement.pp_p2p_bytes(mb_tokens), "nvlink")
            compute = np.where(pipelined, stage_compute, slots * mb_compute) + extra
            comm = np.where(pipelined, stage_comm + hand_off,
                            slots * mb_comm + (slots - 1) * mb_hand_off)
        shape = work.prefill_tokens.shape
        compute, comm = _full(compute, shape), _full(comm, shape)
        busy = compute + comm
        if self.overheads is not None:
            busy = self.overheads.step_s(busy, fixed.cpu, fixed.launch)
        duration = busy[:, 0].copy() if shape[1] == 1 else busy.max(axis=1)  # (one rank)
        return StepTiming(busy=busy, compute=compute, comm=comm, duration=duration,
                          temporary_kv_bytes=self._temporary_kv(work))

    def _counts(self, work: StepWork, lockstep: bool) -> _Counts:
        """The token counts of the step, which is all the memoised pieces read: for a
        run whose steps all see the same counts, one (1, ranks) row of them, so the
        pieces are computed (and remembered) for one step and the sums they enter
        broadcast them to the run's k steps (`memo.same_rows` tells, unless the work
        says so itself: `StepWork.same_counts`, a run of decodes). One rank's row is five
        numbers: the pieces then run on numpy scalars, whose arithmetic is the same
        IEEE arithmetic at a tenth of the cost of 1x1 arrays (lockstep ranks and
        pipeline stages sum over the rank axis: they keep it). Without the memo, the
        whole arrays (`labkit bench sim` compares the two)."""
        counts = (work.prefill_tokens, work.decode_tokens, work.num_prefill_reqs,
                  work.num_decode_reqs, work.idle)
        if self.memo is no_memo or not (work.same_counts or same_rows(counts)):
            return _Counts(*counts)
        if counts[0].shape[1] == 1 and not lockstep and self.layout.pp == 1:
            return _Counts(*(c[0, 0] for c in counts))
        return _Counts(*(c[:1] for c in counts))

    def prices_runs_whole(self, lockstep: bool, ranks: int) -> bool:
        """Is a run of steps whose counts change (a prompt's chunks, then decodes)
        priced as cheaply whole as in parts of equal counts? So with the compiled rows
        (one rank): each run of equal steps asks the memo once. (The numpy path prices
        count pieces once per array: the run's planner prices its chunk steps apart.)"""
        return self.compiled_rows is not None and not lockstep and ranks == 1

    def _count_pieces(self, lockstep: bool, *counts) -> _CountPieces:
        """The pieces of a step that its counts alone decide: graph dispatch, the
        stage's projections and MLP (for the whole step's work), the LM head and drafts.
        A step asks the memo once for them all; only a step whose counts are new asks
        for each piece (which another step may share: the drafts see only the decode
        requests, say). One rank's step with a prompt's chunk reads them off a block of
        prefill sizes priced at once (`count_blocks.py`)."""
        if self.count_blocks is not None and self.count_blocks.takes(lockstep, counts):
            return self.count_blocks.pieces(*counts)
        counts = _Counts(*counts)
        mode, padded = self._graphs(counts, lockstep)
        t_dec, tokens, group = self._stage_tokens(counts, lockstep, padded)
        proj = self._piece("attention_proj", self.attention.projections, tokens, t_dec)
        mlp = self._piece("mlp", self.mlp.layer, tokens, group)
        linear = self.mlp.linear_layer(tokens, counts.prefill_tokens, counts.num_decode_reqs)
        attn_comm = None if self.comm_reads_context else \
            self._attention_comm(tokens, t_dec, counts.prefill_tokens)
        rows = counts.num_prefill_reqs + np.where(counts.idle & lockstep, 1,
                                                   counts.decode_tokens)
        drafts = self._piece("drafts", self.mlp.draft_passes, counts.num_decode_reqs) \
            if self.mlp.has_drafts else 0.0
        extra = self._piece("lm_head", self.mlp.lm_head, rows) + self.sampler(rows) + drafts
        cpu = launch = None
        if self.overheads is not None:
            o = self.overheads
            dp = counts.prefill_tokens.shape[1] if lockstep else 1
            cpu = o.cpu_s(counts.num_prefill_reqs + counts.num_decode_reqs,
                          counts.prefill_tokens + counts.decode_tokens, dp)
            launch = o.launch_s(mode)
        return _CountPieces(mode, padded, t_dec, tokens, proj,
                            self._count_terms(*mlp, linear), attn_comm,
                            self.attention.decoders(counts.num_decode_reqs), extra, cpu, launch)

    def _graphs(self, counts: _Counts, lockstep: bool):
        """(graph mode, padded tokens) of the step (no memo of its own: it reads all
        the counts, as `_count_pieces` does)."""
        if self.overheads is None:
            return None, None
        return self.overheads.graphs(counts, lockstep, self.layout.pcp, self.width)

    def _piece(self, name: str, fn, *args):
        """fn(*args), a pure piece of the step (a function of its counts), through the
        memo."""
        return self.memo(name, fn, args)

    def _stage(self, work: StepWork, counts: _Counts, lockstep: bool, split, padded=None,
               fixed: _CountPieces | None = None):
        """Compute and communication of one pipeline stage's layers, for 1/split of
        the step's work (a micro-batch); also the tokens through one GPU. `padded`:
        the tokens a CUDA graph runs through the GEMMs, padding included. `fixed`: the
        whole step's count pieces, already priced (`_count_pieces`)."""
        if fixed is not None:
            t_dec, tokens, proj = fixed.t_dec, fixed.tokens, fixed.proj
            (compute_terms, comm_terms), attn_comm = fixed.terms, fixed.attn_comm
            decoders = fixed.decoders
        else:
            if not np.all(np.asarray(split) == 1):
                work = _share(work, split)
                counts = _Counts(*(c / split for c in counts[:4]), counts.idle)
            t_dec, tokens, group = self._stage_tokens(counts, lockstep, padded)
            proj = self._piece("attention_proj", self.attention.projections, tokens, t_dec)
            mlp = self._piece("mlp", self.mlp.layer, tokens, group)
            linear = self.mlp.linear_layer(tokens, counts.prefill_tokens, counts.num_decode_reqs)
            compute_terms, comm_terms = self._count_terms(*mlp, linear)
            attn_comm, decoders = None, self.attention.decoders(counts.num_decode_reqs)
        if attn_comm is None:
            attn_comm = self._attention_comm(tokens, t_dec, work.prefill_tokens,
                                             work.kv_read_tokens, _prefill_prefix(work))
        attn = proj + self._attention_core(work, decoders)
        # the stage's sum, layer kinds in a fixed order (the same rounding every time)
        compute, comm = self.full_layers * attn, self.full_layers * attn_comm
        for term in compute_terms:
            compute = compute + term
        for term in comm_terms:
            comm = comm + term
        if self.window_layers:  # (the same collectives as a full-attention layer)
            swa = proj + self._attention_core(work, decoders, self.model.sliding_window)
            compute = compute + self.window_layers * swa
            comm = comm + self.window_layers * attn_comm
        return compute, comm, tokens

    def _stage_tokens(self, counts: _Counts, lockstep: bool, padded):
        """(decode tokens, tokens through this GPU's dense GEMMs, tokens its MoE kernel
        sees routed) of a stage."""
        lay = self.layout
        dummy = counts.idle if lockstep else np.zeros_like(counts.idle)
        t_dec = np.where(dummy, 1, counts.decode_tokens)
        t_pre = counts.prefill_tokens
        tokens = t_pre / lay.pcp + t_dec  # through this GPU's dense GEMMs
        # tokens the MoE kernel of one GPU sees routed: an EP group spans the replica
        # (or, in lockstep, every DP rank); sliced experts see this GPU's tokens
        replica = t_pre + t_dec
        if padded is not None:  # the graph's padding rows run through every GEMM
            tokens, replica = padded, padded * lay.pcp
        if lay.ep == 1:
            group = tokens
        else:
            group = replica.sum(axis=1, keepdims=True) if lockstep else replica
        return t_dec, tokens, group

    # ------------------------------------------------------------- attention
    def _attention_core(self, work: StepWork, decoders: tuple, window: int = 0):
        """One attention layer's core over the step's contexts; `window` > 0: a
        sliding-window layer, whose queries read at most `window` positions each."""
        core = self.attention.decode_core(work, decoders, window)
        if _has_chunks(work):
            core = core + self.attention.prefill_core(work, window)
        return core  # (without chunks, adding prefill's zeros would change no bit)

    def _attention_comm(self, tokens, t_dec, prefill_tokens, kv_read_tokens=0,
                        prefill_prefix=0):
        """One attention layer's collectives. DCP runs attention over token shards
        (gather queries, merge partial outputs) for decode, and for prefill unless the
        chunk gathers the KV instead."""
        sharded = t_dec if self.attention.gathered else tokens
        collectives = self.placement.comm_per_layer(tokens, prefill_tokens, kv_read_tokens,
                                                    prefill_prefix, sharded)
        return priced_collectives(self.ops, collectives)

    # ------------------------------------------------------------ the rest
    def _count_terms(self, mlp, mlp_comm, linear):
        """The stage's compute and comm terms its counts decide, each kind's layer count
        times its layer, in the order the stage adds them after full attention."""
        layers = {"moe": (self.moe_layers, mlp[1], mlp_comm[1]),
                  "dense": (self.dense_layers, mlp[0], mlp_comm[0]),
                  "linear": (self.linear_layers, linear, 0.0)}
        compute = tuple(layers[k][0] * layers[k][1] for k in self.kinds)
        comm = tuple(layers[k][0] * layers[k][2] for k in self.kinds if k != "linear")
        return compute, comm

    def _temporary_kv(self, work: StepWork):
        lay, p = self.layout, self.placement
        per_layer = self.attention.kv_per_layer
        if lay.pcp > 1 and lay.dcp > 1:
            prefill_kv = work.kv_read_tokens - (work.decode_context + work.decode_tokens)
            return prefill_kv * per_layer
        if p.gathers_prefix_for_prefill():
            return _prefill_prefix(work) * per_layer
        if lay.kvpp > 1:
            return work.kv_read_tokens * per_layer
        return np.zeros(work.prefill_tokens.shape)


def _share(work: StepWork, split) -> StepWork:
    """1/split of a step's work: a micro-batch of its requests."""
    fields = {f: getattr(work, f) / split for f in (
        "prefill_tokens", "decode_tokens", "num_prefill_reqs", "num_decode_reqs",
        "kv_read_tokens", "prefill_pairs", "decode_pairs", "decode_context")}
    return StepWork(**fields, idle=work.idle, prefill_chunks=work.prefill_chunks,
                    chunk_share=split)


def _full(x, shape) -> np.ndarray:
    """x as a float array of `shape` (x itself when it already is one: the step's sums
    are new arrays, never the memo's)."""
    if type(x) is np.ndarray and x.shape == shape and x.dtype == np.float64:
        return x
    out = np.empty(shape)  # (filled by broadcasting, as np.full does a number)
    out[...] = x
    return out


def _has_chunks(work: StepWork) -> bool:
    return work.prefill_chunks is not None and len(work.prefill_chunks[0]) > 0


def _prefill_prefix(work: StepWork):
    """Cached tokens the step's prefill chunks attend over, summed."""
    return (work.kv_read_tokens - work.decode_context - work.decode_tokens
            - work.prefill_tokens)
