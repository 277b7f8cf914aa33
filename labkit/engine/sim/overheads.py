"""What an engine step costs beyond its kernels, as vLLM pays it.

The cost model prices kernels as vLLM runs them inside CUDA graphs. A real step also
needs the CPU — to schedule, to prepare inputs (token ids, positions, block tables,
attention metadata), to launch the forward pass, to sample and process outputs — and
how much of that the GPU waits for depends on three of vLLM's settings:

**CUDA graphs** (`compilation_config.cudagraph_mode`, `cudagraph_capture_sizes`,
`max_cudagraph_capture_size`). vLLM captures the forward pass for a list of token
counts; a step runs the graph of the smallest captured size that holds its tokens, its
batch padded up to that size (the padding tokens go through every GEMM). With the
default FULL_AND_PIECEWISE, a *uniform decode* batch (every request decoding 1 + drafts
tokens) replays a FULL graph — one launch for the whole forward; a mixed or prefill
batch replays PIECEWISE graphs, the pieces between attention ops captured, attention
itself launched eagerly each layer; a batch larger than the largest capture size runs
eagerly (NONE), every kernel launched from Python. The default capture sizes are
1, 2, 4, then every 8 up to 256 and every 16 up to `max_cudagraph_capture_size`
(default min(2 · max_num_seqs · (1 + drafts), 512), never above
`max_num_batched_tokens`, which is captured itself when it fits), rounded up to
multiples of 1 + drafts when speculating; FULL decode graphs exist for sizes up to
(1 + drafts) · max_num_seqs (vLLM's `CudagraphDispatcher`).

**Async scheduling** (`async_scheduling`, on by default in vLLM). Without it the GPU
idles while the CPU schedules the next step and prepares its inputs: a step lasts
CPU + GPU. With it the scheduler runs one step ahead and the worker prepares and
launches step N+1 while step N runs, so a step lasts max(CPU, GPU). A small
per-step gap stays either way (the sampled tokens' device-to-host copy and the
hand-off between steps). Async scheduling has a price the scheduler pays: a request
that arrives while a step runs misses the step already scheduled (see `instance.py`).

**DP coordination** (DEP, lockstep ranks). Before every forward each DP rank
all-reduces a few integers with the others on the CPU (vLLM's `coordinate_batch_across_dp`,
gloo under async scheduling): the ranks agree on one graph mode — eager if any rank
must run eagerly — and, when graphs run, pad every rank's batch to the largest padded
batch among them, so the MoE all-to-alls line up; an idle rank runs a dummy batch of
that size. The all-reduce costs `dp_sync_hop_s` per step of a recursive-doubling
exchange (2 · ceil(log2 ranks) hops).

CPU time per step = `cpu_step_s` + `cpu_per_request_s` · requests + `cpu_per_token_s` ·
tokens + launch, where launch is 0 under a FULL graph, `piecewise_layer_s` per layer
under PIECEWISE and `eager_layer_s` per layer eagerly. The constants are fitted on
measured serving runs (`labkit.validate.fit`, the fitted part of
../shared/data/e2e only) and pasted below; `labkit validate` reports how well they
carry to the held-out runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba.extending import register_jitable

from labkit.errors import ConfigError
from labkit.specs.config import CUDAGRAPH_MODES
NONE, PIECEWISE, FULL = 0, 1, 2  # runtime modes, ordered as vLLM's CUDAGraphMode values
DEFAULT_MAX_CAPTURE = 512  # vLLM's platform default ceiling on Hopper-class GPUs


@dataclass(frozen=True, slots=True)
class OverheadParams:
    step_gap_s: float  # GPU idle between steps that no overlap hides
    cpu_step_s: float  # schedule + prepare inputs + sample + process outputs: fixed part
    cpu_per_request_s: float  # ... per request in the batch
    cpu_per_token_s: float  # ... per token scheduled
    piecewise_layer_s: float  # CPU per layer of a PIECEWISE step (eager attention + pieces)
    eager_layer_s: float  # CPU per layer launching every kernel from Python
    dp_sync_hop_s: float  # one hop of the DP ranks' CPU all-reduce (gloo)


# ---- fitted values (python -m labkit.validate.fit) ----------------------------------
# step_gap_s fitted; the rest documented, not fitted (the measured runs hide them: see
# labkit/validate/fit.py): V1's scheduler + input preparation + the sampler's CPU side
# (its GPU passes are priced by `sampler_cost.py`, before the fit) ~0.5 ms plus
# ~15 us per request and ~1 us per token, a piecewise graph's eager attention ~40 us per
# layer, an eager forward ~200 us per layer of Python launches, a gloo hop ~25 us.
FITTED = OverheadParams(step_gap_s=4.351e-4, cpu_step_s=5.0e-4, cpu_per_request_s=1.5e-5,
                        cpu_per_token_s=1.0e-6, piecewise_layer_s=4.0e-5,
                        eager_layer_s=2.0e-4, dp_sync_hop_s=2.5e-5)


def capture_sizes(max_num_seqs: int, max_num_batched_tokens: int, decode_query_len: int = 1,
                  sizes: tuple[int, ...] | None = None,
                  max_size: int | None = None) -> np.ndarray:
    """The token counts vLLM captures graphs for (ascending), as its config resolves
    them from `cudagraph_capture_sizes` / `max_cudagraph_capture_size`."""
    if sizes:
        chosen = sorted({s for s in sizes if s <= max_num_batched_tokens})
        if max_size is not None and chosen and max_size != chosen[-1]:
            raise ConfigError(f"max_cudagraph_capture_size={max_size} disagrees with "
                              f"cudagraph_capture_sizes (largest {chosen[-1]}); give one")
    else:
        if max_size is None:
            max_size = min(max_num_seqs * decode_query_len * 2, DEFAULT_MAX_CAPTURE)
        max_size = min(max_size, max_num_batched_tokens)
        chosen = [s for s in (1, 2, 4) if s <= max_size]
        chosen += list(range(8, min(max_size + 1, 256), 8))
        chosen += list(range(256, max_size + 1, 16))
        if max_num_batched_tokens <= max_size:
            chosen.append(max_num_batched_tokens)
    if decode_query_len > 1 and chosen:  # spec decode: multiples of 1 + drafts
        q = decode_query_len
        top = chosen[-1]
        rounded = sorted({-(-s // q) * q for s in chosen if -(-s // q) * q <= top})
        chosen = rounded or ([q] if q <= top else [])
    return np.array(sorted(set(chosen)), dtype=np.int64)


class StepOverheads:
    """Graph dispatch, padding and the CPU's share of one engine step (see module doc)."""

    def __init__(self, params: OverheadParams, *, mode: str = "FULL_AND_PIECEWISE",
                 sizes: np.ndarray, decode_query_len: int = 1, max_num_seqs: int = 256,
                 async_scheduling: bool = True, layers: float = 1.0) -> None:
        if mode not in CUDAGRAPH_MODES:
            raise ConfigError(f"cudagraph_mode={mode!r} is not allowed; allowed: "
                              f"{', '.join(CUDAGRAPH_MODES)}")
        self.params = params
        self.mode = mode
        self.async_scheduling = async_scheduling
        self.layers = layers
        none = mode == "NONE" or len(sizes) == 0
        mixed = sizes if mode in ("FULL_AND_PIECEWISE", "FULL", "PIECEWISE") and not none \
            else np.empty(0, dtype=np.int64)
        q = decode_query_len
        decode = sizes[(sizes >= q) & (sizes <= q * max_num_seqs)] \
            if mode in ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "FULL") and not none \
            else np.empty(0, dtype=np.int64)
        # lookup tables over batch sizes 0..top: [mixed, uniform decode] x (padded size,
        # runtime mode); a padded size of 0 means no graph holds the batch
        self.top = int(max(sizes.max(initial=0), 1))
        self._pad = np.zeros((2, self.top + 1))
        self._mode = np.full((2, self.top + 1), NONE, dtype=np.int64)
        for row, kind_sizes, runtime in ((0, mixed, FULL if mode == "FULL" else PIECEWISE),
                                         (1, decode, FULL)):
            if len(kind_sizes):
                t = np.arange(1, self.top + 1)
                i = np.searchsorted(kind_sizes, t)
                fits = i < len(kind_sizes)
                top = kind_sizes[np.minimum(i, len(kind_sizes) - 1)]
                self._pad[row, 1:] = np.where(fits, top, 0)
                self._mode[row, 1:] = np.where(fits, runtime, NONE)
        # a uniform decode batch no decode graph holds replays the mixed graphs
        no_decode = self._pad[1] == 0
        self._pad[1, no_decode] = self._pad[0, no_decode]
        self._mode[1, no_decode] = self._mode[0, no_decode]
        self._launch = np.array([params.eager_layer_s, params.piecewise_layer_s, 0.0]) * layers

    @property
    def min_step_s(self) -> float:
        p = self.params
        return p.step_gap_s + (0.0 if self.async_scheduling else p.cpu_step_s)

    # ------------------------------------------------------------- dispatch
    def dispatch(self, tokens: np.ndarray, uniform_decode: np.ndarray):
        """(runtime mode, padded tokens) of batches of `tokens` (any shape): a uniform
        decode batch replays the FULL graph of the next decode capture size; any other
        batch the mixed-mode graph of the next capture size; beyond them, eager."""
        tokens = np.asarray(tokens, dtype=float)
        size = np.ceil(tokens)
        idx = np.where(size <= self.top, size, 0).astype(np.intp)
        kind = np.asarray(uniform_decode, dtype=np.intp)
        padded = self._pad[kind, idx]
        return self._mode[kind, idx], np.where(padded > 0, padded, tokens)

    def graphs(self, work, lockstep: bool, pcp: int = 1, decode_query_len: int = 1):
        """Each rank's graph mode and the tokens its GEMMs run for a `StepWork` (padded
        to the capture size; lockstep ranks agree on one mode and one padded size; an
        idle lockstep rank runs a one-token dummy batch, padded like the others)."""
        dummy = work.idle & lockstep
        tokens = work.prefill_tokens / pcp + np.where(dummy, 1, work.decode_tokens)
        uniform = (work.num_prefill_reqs == 0) & \
            ((work.decode_tokens == decode_query_len * work.num_decode_reqs) | dummy)
        mode, padded = self.dispatch(tokens, uniform)
        if lockstep and tokens.shape[-1] > 1:
            mode, padded = self.sync_ranks(mode, padded, tokens)
        return mode, padded

    def sync_ranks(self, mode: np.ndarray, padded: np.ndarray, tokens: np.ndarray):
        """Lockstep DP ranks (last axis) agree: the lowest mode of any rank; with graphs,
        every rank padded to the largest padded batch; eagerly, no padding at all."""
        synced = mode.min(axis=-1, keepdims=True)
        largest = padded.max(axis=-1, keepdims=True)
        mode = np.broadcast_to(synced, mode.shape)
        padded = np.where(synced > NONE, np.broadcast_to(largest, padded.shape), tokens)
        return mode, padded

    # ------------------------------------------------------------------ time
    def launch_s(self, mode: np.ndarray) -> np.ndarray:
        """CPU launches of a step: none under a FULL graph, the attention of every layer
        under PIECEWISE, every kernel of every layer eagerly."""
        return self._launch[mode]

    def cpu_s(self, num_reqs: np.ndarray, tokens: np.ndarray, dp_ranks: int = 1) -> np.ndarray:
        """Scheduling, input preparation, sampling and output processing of one step
        (DP coordination included), launches excluded."""
        p = self.params
        cpu = p.cpu_step_s + p.cpu_per_request_s * num_reqs + p.cpu_per_token_s * tokens
        if dp_ranks > 1:
            cpu = cpu + p.dp_sync_hop_s * 2 * np.ceil(np.log2(dp_ranks))
        return cpu

    def step_s(self, gpu: np.ndarray, cpu: np.ndarray, launch: np.ndarray) -> np.ndarray:
        """One rank's step: GPU kernels and CPU work, overlapped as the scheduler allows."""
        return overlapped_step_s(gpu, cpu, launch, self.params.step_gap_s,
                                 self.async_scheduling)


@register_jitable  # (a plain function; the engine's compiled rows call it too)
def overlapped_step_s(gpu, cpu, launch, gap: float, async_scheduling: bool):
    """`StepOverheads.step_s` on numbers: async scheduling prepares the next step while
    the GPU runs this one; otherwise the CPU work comes first."""
    if async_scheduling:
        return np.maximum(gpu, cpu + launch) + gap
    return cpu + np.maximum(gpu, launch) + gap
