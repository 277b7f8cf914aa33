"""Dense GEMM `[m, k] x [k, n]`: a roofline with a tile overhead and a launch latency.

Physics, per GEMM:

- compute: 2*m*n*k FLOPs at `compute_eff` of the dtype's peak. Each output tile also
  pays a fixed prologue/epilogue (loading the pipeline, writing the result) worth
  `tile_overhead_k` extra steps along k, so a GEMM with short k runs below peak:
  time ~ 2*m*n*(k + k0) / (peak * eff).
- memory: both operands read once and the bf16 output written once,
  (m*k + k*n) * operand bytes + m*n*2, at `memory_eff` of HBM bandwidth. Small-m
  GEMMs (decode) are this term: the weight matrix streamed through HBM.
- fp8 activations are quantized first (vLLM quantizes per token, dynamically): one more
  pass over the activations (read bf16, write fp8) plus a per-row cost, because the
  quantization kernel gives each row to one thread block (`quant_row_s` per row, on one
  SM; rows spread over all SMs). DeepGEMM's (fp8_block) quantizes in 1x128 groups with
  a vectorized kernel and has no per-row cost.
- a fixed `launch_s` (kernel launch, tail of the last wave).

time = launch + quant + smooth_max(compute, memory)

Kernels modelled (vLLM 0.24 on H100): bf16 = torch.nn.functional.linear (cuBLAS);
fp8 = CutlassFP8ScaledMMLinearKernel (per-tensor weights, per-token dynamic activations,
what an fp8 Llama checkpoint runs); fp8_block = DeepGemmFp8BlockScaledMMKernel (128x128
block-scaled weights, what DeepSeek-style fp8 checkpoints run).
"""

from __future__ import annotations

import numpy as np

from labkit.costmodel.curves import smooth_max
from labkit.costmodel.device import Device
from labkit.costmodel.params import GemmParams
from labkit.errors import unknown_choice

GEMM_DTYPES = ("bf16", "fp8", "fp8_block")
_OPERAND_BYTES = {"bf16": 2.0, "fp8": 1.0, "fp8_block": 1.0}


def check_gemm_dtype(dtype: str) -> None:
    if dtype not in GEMM_DTYPES:
        raise unknown_choice("GEMM dtype", dtype, GEMM_DTYPES)


def gemm_seconds(dev: Device, p: GemmParams, m, n, k, dtype: str) -> np.ndarray:
    """Seconds for one GEMM kernel as serving runs it (CUDA graphs, no host overhead)."""
    operand = _OPERAND_BYTES[dtype]
    compute = 2.0 * m * n * (k + p.tile_overhead_k) / (dev.flops(dtype) * p.compute_eff)
    traffic = (m * k + k * n) * operand + m * n * 2.0
    memory = traffic / (dev.hbm_bandwidth * p.memory_eff)
    quant = 0.0
    if dtype != "bf16":
        # read bf16 activations, write fp8 ones; one thread block per row
        quant = m * k * 3.0 / (dev.hbm_bandwidth * p.memory_eff) + m * p.quant_row_s / dev.sms
    return p.launch_s + quant + smooth_max(compute, memory)


def batched_gemm_seconds(dev: Device, p: GemmParams, batch, m, n, k, dtype: str) -> np.ndarray:
    """`batch` independent GEMMs of the same shape in one kernel (torch.bmm), e.g. MLA's
    per-head absorbed up-projections: the work of one GEMM `batch` times over, launched
    once."""
    operand = _OPERAND_BYTES[dtype]
    compute = 2.0 * batch * m * n * (k + p.tile_overhead_k) / (dev.flops(dtype) * p.compute_eff)
    traffic = batch * ((m * k + k * n) * operand + m * n * 2.0)
    memory = traffic / (dev.hbm_bandwidth * p.memory_eff)
    return p.launch_s + smooth_max(compute, memory)
