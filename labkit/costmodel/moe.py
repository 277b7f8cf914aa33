"""A fused MoE layer on one GPU (router excluded): grouped GEMMs over the local experts.

With `num_experts` experts spread over `ep_size` GPUs and each expert's intermediate
dim split over `tp_size`, one GPU holds E/ep experts of width I/tp. Of the T*topk routed
(token, expert) rows, T*topk/ep land on this GPU's experts when routing is balanced.

- compute: every local row runs gate+up ([H] -> [2I/tp]) and down ([I/tp] -> [H]):
  2 * 3 * H * I/tp FLOPs, at `compute_eff` of the dtype's peak;
- memory: the weights of every *active* local expert (3 * H * I/tp each) stream
  through HBM once, plus the activations. With balanced routing min(local experts,
  local rows) experts are active; with skewed routing ("power_law") rows collide on
  hot experts and fewer are active: rows * E / (rows + E), a saturation that equals
  rows when they are few and the expert count when they are many. Skewed routing also
  loads EP ranks unevenly; the GPU priced is then the busiest one, holding
  1 + `power_law_skew` * (1 - 1/ep) times its balanced share of rows (fitted on
  vLLM's power-law routing with alpha 1.01 and 1.2, which measures the busiest rank);
- grid: the fused kernels sort and pad *all* T*topk rows and launch thread blocks over
  them for every output column, even rows routed to other GPUs' experts (which exit
  early), so a cost proportional to T*topk*(2I/tp + H) is paid on every GPU
  (`grid_s` per row and column, on one SM). This is why EP ranks are not ep times
  faster at large batch;
- a fixed `launch_s` (routing-metadata kernels, quantization, the two GEMMs, the
  activation and the final reduction).

time = launch + grid + smooth_max(compute, memory)

Kernels modelled: bf16 = vLLM's Triton fused MoE (unquantized); fp8 = block-scaled
fp8 (128x128 weight blocks, DeepSeek-style): Triton fused MoE without EP and FlashInfer
CUTLASS with EP, the two kernels vLLM 0.24 picks on H100, fitted as one.
"""

from __future__ import annotations

import numpy as np

from labkit.costmodel.curves import smooth_max
from labkit.costmodel.device import Device
from labkit.costmodel.params import MoeParams
from labkit.errors import unknown_choice

MOE_DTYPES = {"bf16": "bf16", "fp8": "fp8", "fp8_block": "fp8"}
MOE_DISTRIBUTIONS = ("balanced", "power_law")


def check_moe_args(dtype: str, distribution: str) -> str:
    if dtype not in MOE_DTYPES:
        raise unknown_choice("MoE dtype", dtype, MOE_DTYPES)
    if distribution not in MOE_DISTRIBUTIONS:
        raise unknown_choice("MoE token distribution", distribution, MOE_DISTRIBUTIONS)
    return MOE_DTYPES[dtype]


def moe_seconds(dev: Device, p: MoeParams, num_tokens, hidden, inter, topk, num_experts,
                ep_size, tp_size, dtype: str, distribution: str) -> np.ndarray:
    weight_bytes = 2.0 if dtype == "bf16" else 1.0
    width = inter / tp_size
    local_experts = num_experts / ep_size
    rows = num_tokens * topk / ep_size
    if distribution == "power_law":
        # the busiest EP rank: `power_law_skew` more than its share, up to every token
        # using every local expert (a token picks an expert at most once)
        busiest = rows * (1.0 + p.power_law_skew * (1.0 - 1.0 / ep_size))
        rows = np.minimum(busiest, num_tokens * np.minimum(topk, local_experts))
    touched = np.maximum(rows, 1.0)  # the measured GPU always holds at least one row
    if distribution == "balanced":
        active = np.minimum(local_experts, touched)
    else:
        active = touched * local_experts / (touched + local_experts)
    compute = 2.0 * 3.0 * hidden * width * rows / (dev.flops(dtype) * p.compute_eff)
    weights = active * 3.0 * hidden * width * weight_bytes
    activations = rows * (hidden + 3.0 * width + hidden) * 2.0 + num_tokens * hidden * 4.0
    memory = (weights + activations) / (dev.hbm_bandwidth * p.memory_eff)
    grid = num_tokens * topk * (2.0 * width + hidden) * p.grid_s / dev.sms
    return p.launch_s + grid + smooth_max(compute, memory)
