"""A fused MoE layer on one GPU (router excluded): grouped GEMMs over the local experts.

With `num_experts` experts spread over `ep_size` GPUs and each expert's intermediate
dim split over `tp_size`, one GPU holds E/ep experts of width I/tp. Of the T*topk routed
(token, expert) rows, T*topk/ep land on this GPU's experts when routing is balanced.

- compute: every local row runs gate+up ([H] -> [2I/tp]) and down ([I/tp] -> [H]):
  2 * 3 * H * I/tp FLOPs, at `compute_eff` of the dtype's peak;
- memory: the weights of every *active* local expert (3 * H * I/tp each) stream
  through HBM once, plus the activations. With balanced routing min(local experts,
  local rows) experts are active; with skewed routing ("power_law_<alpha>") rows
  collide on hot experts and fewer are active: rows * E / (rows + E), a saturation that
  equals rows when they are few and the expert count when they are many. Skewed
  routing also loads EP ranks unevenly; the GPU priced is then the busiest one, holding
  `load_factor` times its balanced share of rows (up to every token using every local
  expert) — by default the factor `routing.busiest_factor` derives from the routing
  distribution itself, which is how the calibration data measured it (nothing fitted);
- grid: the fused kernels sort and pad *all* T*topk rows and launch thread blocks over
  them for every output column, even rows routed to other GPUs' experts (which exit
  early), so a cost proportional to T*topk*(2I/tp + H) is paid on every GPU
  (`grid_s` per row and column, on one SM). This is why EP ranks are not ep times
  faster at large batch;
- a fixed `launch_s` (routing-metadata kernels, quantization, the two GEMMs, the
  activation and the final reduction).

time = launch + grid + smooth_max(compute, memory)

Kernels modelled, each with its own fitted constants: bf16 = vLLM's Triton fused MoE
(unquantized); fp8_block = block-scaled fp8 (128x128 weight blocks, DeepSeek-style):
Triton fused MoE without EP and FlashInfer CUTLASS with EP, the two kernels vLLM 0.24
picks on H100, fitted as one; fp8 = per-tensor fp8 (ModelOpt checkpoints, FlashInfer
CUTLASS), two to four times slower than the block-scaled kernel on the same shapes.
"""

from __future__ import annotations

import numpy as np

from labkit.costmodel.curves import smooth_max
from labkit.costmodel.device import Device
from labkit.costmodel.params import MoeParams
from labkit.costmodel.routing import ROUTINGS, busiest_factor
from labkit.errors import unknown_choice

MOE_DTYPES = ("bf16", "fp8", "fp8_block")
# "power_law" alone: aiconfigurator's default exponent
MOE_DISTRIBUTIONS = ("balanced", "power_law", *ROUTINGS[1:])


def check_moe_args(dtype: str, distribution: str) -> str:
    """The routing name `distribution` stands for (validating both arguments)."""
    if dtype not in MOE_DTYPES:
        raise unknown_choice("MoE dtype", dtype, MOE_DTYPES)
    if distribution not in MOE_DISTRIBUTIONS:
        raise unknown_choice("MoE token distribution", distribution, MOE_DISTRIBUTIONS)
    return "power_law_1.2" if distribution == "power_law" else distribution


def default_load_factor(num_tokens, num_experts, topk, ep_size, routing: str) -> np.ndarray:
    """The busiest EP rank's load factor under `routing` (calibration draws), elementwise
    over arrays of shapes: one table per distinct (experts, topk, ep)."""
    shape = np.broadcast(num_tokens, num_experts, topk, ep_size).shape
    t, e, k, ep = (np.broadcast_to(np.asarray(x, dtype=float), shape)
                   for x in (num_tokens, num_experts, topk, ep_size))
    out = np.ones(shape)
    if routing == "balanced":
        return out
    keys = np.stack([e.ravel(), k.ravel(), ep.ravel()], axis=1)
    for key in np.unique(keys, axis=0):
        mask = (keys == key).all(axis=1).reshape(shape)
        out[mask] = busiest_factor(t[mask], int(key[0]), int(key[1]), int(key[2]), routing)
    return out


def moe_seconds(dev: Device, p: MoeParams, num_tokens, hidden, inter, topk, num_experts,
                ep_size, tp_size, dtype: str, routing: str, load_factor) -> np.ndarray:
    weight_bytes = 2.0 if dtype == "bf16" else 1.0
    width = inter / tp_size
    local_experts = num_experts / ep_size
    rows = num_tokens * topk / ep_size
    if routing != "balanced":
        # the busiest EP rank, up to every token using every local expert (a token
        # picks an expert at most once)
        rows = np.minimum(rows * load_factor, num_tokens * np.minimum(topk, local_experts))
    touched = np.maximum(rows, 1.0)  # the measured GPU always holds at least one row
    if routing == "balanced":
        active = np.minimum(local_experts, touched)
    else:
        active = touched * local_experts / (touched + local_experts)
    compute = 2.0 * 3.0 * hidden * width * rows / (dev.flops(dtype) * p.compute_eff)
    weights = active * 3.0 * hidden * width * weight_bytes
    activations = rows * (hidden + 3.0 * width + hidden) * 2.0 + num_tokens * hidden * 4.0
    memory = (weights + activations) / (dev.hbm_bandwidth * p.memory_eff)
    grid = num_tokens * topk * (2.0 * width + hidden) * p.grid_s / dev.sms
    return p.launch_s + grid + smooth_max(compute, memory)
