"""The cost model's fitted constants: what kernels achieve, as fractions of datasheet peaks.

Every number below was fitted by `python -m labkit.costmodel.fit` on the measured H100
SXM kernel latencies in ../shared/data/calibration/h100_sxm (vLLM 0.24 kernels, NCCL
2.29) and is pasted here, so the model needs no data at run time. Efficiencies are
dimensionless fractions of a `HardwareSpec` peak; latencies are seconds; `*_unit_s`
style costs are seconds of one SM per work unit (divided by the GPU's SM count when
priced). None of them names a GPU: moving to an H200 or B200 changes the peaks, not
these.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class GemmParams:
    launch_s: float  # kernel launch + last-wave tail (+ the quantization kernel for fp8)
    compute_eff: float  # fraction of the dtype's peak FLOP/s on large tiles
    memory_eff: float  # fraction of HBM bandwidth when streaming operands
    tile_overhead_k: float  # per-tile prologue/epilogue, in steps along k
    quant_row_s: float = 0.0  # fp8: per-row cost of per-token activation quantization (one SM)
    harness_s: float = 0.0  # host overhead inside the *measurement* only (see fit.py); not
    #                         part of serving time, added back by the bench


@dataclass(frozen=True, slots=True)
class DecodeAttentionParams:
    launch_s: float
    memory_eff: float  # fraction of HBM bandwidth streaming the KV cache
    unit_s: float  # one (sequence, KV head) work unit at head_dim 128, on one SM
    fp8_kv_factor: float  # cost of an fp8 KV byte relative to a bf16 one (dequantization)


@dataclass(frozen=True, slots=True)
class PrefillAttentionParams:
    launch_s: float
    compute_eff: float  # fraction of bf16 peak on the QK^T / PV MMAs
    softmax_dims: float  # softmax cost per (query, key, head) as extra head dims of MMA
    memory_eff: float
    unit_s: float  # one (sequence, KV head) work unit at head_dim 128, on one SM
    fp8_kv_factor: float  # slowdown of the compute with an fp8 KV cache


@dataclass(frozen=True, slots=True)
class MlaParams:
    launch_s: float  # absorbed (latent) attention core
    memory_eff: float
    compute_eff: float
    unit_s: float  # one (sequence, 64 query heads) unit, on one SM
    fp8_kv_factor: float
    prefill_compute_eff: float  # FA3 on MLA's 192/128 head dims (MHA prefill), of bf16 peak
    decode_overhead_s: float  # module: fixed cost of its small kernels (absorbed path)
    prefill_overhead_s: float  # module: the same on the MHA prefill path
    token_bytes: float  # module: HBM traffic per token of its small kernels (norms, rope, ...)


@dataclass(frozen=True, slots=True)
class MoeParams:
    launch_s: float
    compute_eff: float
    memory_eff: float
    grid_s: float  # per routed row and output column, on one SM


@dataclass(frozen=True, slots=True)
class CommParams:
    base_s: float  # low-latency protocol: fixed cost of any collective
    hop_s: float  # low-latency protocol: per ring step inside an NVLink node
    ll_eff: float  # low-latency protocol: fraction of link bandwidth (flags share the lines)
    bulk_base_s: float  # bulk protocol: fixed cost
    bus_eff: dict[str, float] = field(default_factory=dict)  # bulk protocol, per op


@dataclass(frozen=True, slots=True)
class CostModelParams:
    gemm: dict[str, GemmParams]
    decode_attention: DecodeAttentionParams
    prefill_attention: PrefillAttentionParams
    mla: MlaParams
    moe: dict[str, MoeParams]
    comm: CommParams


# ---- fitted values (python -m labkit.costmodel.fit) -----------------------------------
CALIBRATED = CostModelParams(
    gemm={
        "bf16": GemmParams(launch_s=3.014e-06, compute_eff=0.8475, memory_eff=0.867,
                           tile_overhead_k=58.67),
        "fp8": GemmParams(launch_s=5.84e-06, compute_eff=0.5905, memory_eff=0.7208,
                          tile_overhead_k=0.0, quant_row_s=8.229e-07),
        "fp8_block": GemmParams(launch_s=5.84e-06, compute_eff=0.7941, memory_eff=0.867,
                                tile_overhead_k=0.0, harness_s=7.443e-05),
    },
    decode_attention=DecodeAttentionParams(launch_s=1.211e-05, memory_eff=0.8779,
                                           unit_s=4.117e-06, fp8_kv_factor=1.445),
    prefill_attention=PrefillAttentionParams(launch_s=1.258e-05, compute_eff=0.7925,
                                             softmax_dims=40.61, memory_eff=0.293,
                                             unit_s=3.369e-06, fp8_kv_factor=1.179),
    mla=MlaParams(launch_s=1.211e-05, memory_eff=0.8969, compute_eff=0.7862, unit_s=1.471e-05,
                  fp8_kv_factor=1.11, prefill_compute_eff=0.9222, decode_overhead_s=6.122e-05,
                  prefill_overhead_s=4.698e-05, token_bytes=1.338e+05),
    moe={
        "bf16": MoeParams(launch_s=3.867e-05, compute_eff=0.6857, memory_eff=0.8978,
                          grid_s=2.383e-10),
        # per-tensor fp8 (ModelOpt / FlashInfer CUTLASS): far from HBM speed at any size
        "fp8": MoeParams(launch_s=3.817e-05, compute_eff=0.1727, memory_eff=0.1885, grid_s=0.0),
        "fp8_block": MoeParams(launch_s=2.868e-05, compute_eff=0.2722, memory_eff=0.8098,
                               grid_s=2.987e-11),
    },
    comm=CommParams(base_s=5.898e-06, hop_s=6.896e-07, ll_eff=0.2839, bulk_base_s=2.188e-05,
                    bus_eff={"all_reduce": 0.7115, "all_gather": 0.6528,
                             "reduce_scatter": 0.6569, "all_to_all": 0.6559}),
)
