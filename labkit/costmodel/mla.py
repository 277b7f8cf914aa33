"""Multi-head latent attention (DeepSeek-V3, Kimi-K2): the core and the whole module.

Each token caches one latent vector (kv_lora 512 + rope 64 dims) shared by all heads.

**Decode (absorbed).** The per-head up-projections are folded into the query and the
output (W_UK into q, W_UV after attention), so attention runs directly over the latent
cache as if it were one 576-dim KV head shared by all query heads: memory streams the
latent cache once, compute is 2 * heads * (576 + 512) FLOPs per (query, key) pair. At
128 heads that is ~240 FLOP per cached byte, close to the H100 ridge, so both limits
matter. Kernels: FlashAttention-MLA (bf16 cache) and FlashMLA (fp8 cache); a work unit
is one sequence x 64 query heads.

**Prefill (MHA style).** vLLM up-projects the latent of the new tokens (and, with a
cached prefix, of the prefix) with kv_b_proj into per-head K (128 nope + 64 rope) and
V (128), then runs FlashAttention-3 as multi-head attention with head dims 192/128.
Its physics are those of `attention.prefill_core_seconds`, reusing FA3's fitted
constants except its efficiency: on these wider heads FA3 runs closer to peak than on
128-dim GQA heads (more MMA work per softmax), so that one is fitted on the module.

**Module.** The data measures vLLM's whole DeepseekV2MLAAttention at `num_heads` per GPU:

    fused q_a + kv_a proj  [T, 7168] x [7168, 1536 + 576]         weights dtype
    q_b proj               [T, 1536] x [1536, heads * 192]         weights dtype
    decode:   W_UK bmm     heads x [T, 128] x [128, 512]           bf16
              core (absorbed, over the latent cache)
              W_UV bmm     heads x [T, 512] x [512, 128]           bf16
    prefill:  kv_b proj    [T_kv, 512] x [512, heads * 256]        weights dtype
              core (MHA, FA3)
    o proj                 [T, heads * 128] x [heads * 128, 7168]  weights dtype

(T = new tokens, T_kv = new + prefix tokens; W_UK / W_UV are kv_b_proj's weights,
kept in bf16 even in fp8 checkpoints) plus a handful of small kernels (two RMSNorms,
rope, the cache write, splits and copies): a fixed overhead per path and `token_bytes`
of HBM traffic per token, both fitted. That traffic comes out at ~130 KB per token
(~40 ns on an H100), the same with 1 head or 128 and with bf16 or fp8 GEMMs; the data
does not say which kernels pay it.

vLLM sends short "prefills" down the absorbed decode path: up to 512 new tokens per
sequence with a bf16 cache (FlashAttention-MLA), 128 with fp8 (FlashMLA).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from labkit.costmodel.attention import prefill_core_seconds
from labkit.costmodel.curves import causal_pairs, ceil_div, sharp_max, smooth_max
from labkit.costmodel.device import Device
from labkit.costmodel.gemm import batched_gemm_seconds, gemm_seconds
from labkit.costmodel.params import CostModelParams, MlaParams

HEAD_TILE = 64  # FlashMLA processes 64 query heads (x query tokens) per thread block
# New tokens per sequence up to which vLLM runs a prefill through the absorbed decode
# kernel (its reorder_batch_threshold per backend), by KV-cache dtype.
ABSORBED_PREFILL_MAX_TOKENS = {"bf16": 512, "fp8": 128}


@dataclass(frozen=True, slots=True)
class MlaDims:
    """DeepSeek-V3's MLA shape (Kimi-K2 shares it; only the head count differs)."""

    hidden: int = 7168
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128


def absorbed_core_seconds(dev: Device, p: MlaParams, batch, query_len, context, num_heads,
                          kv_lora_rank, qk_rope_head_dim, kv_bytes: float,
                          kv_dtype: str) -> np.ndarray:
    """Attention over the latent cache: `query_len` new tokens per sequence after `context`
    cached ones (1 for plain decode, 1 + drafts for speculative verification)."""
    latent = kv_lora_rank + qk_rope_head_dim
    pair_flops = 2.0 * (latent + kv_lora_rank)  # QK^T over 576 dims, PV over 512
    compute = (batch * num_heads * causal_pairs(query_len, context) * pair_flops
               / (dev.flops("bf16") * p.compute_eff))
    fp8 = p.fp8_kv_factor if kv_dtype == "fp8" else 1.0
    cache = batch * (context + query_len) * latent * kv_bytes * fp8
    q_and_o = batch * query_len * num_heads * (latent + kv_lora_rank) * 2.0
    memory = (cache + q_and_o) / (dev.hbm_bandwidth * p.memory_eff)
    units = batch * ceil_div(num_heads * query_len, HEAD_TILE) * p.unit_s / dev.sms
    return p.launch_s + smooth_max(sharp_max(compute, memory), units)


def _projections_in(dev: Device, params: CostModelParams, tokens, num_heads, d: MlaDims,
                    gemm_dtype: str) -> np.ndarray:
    g = params.gemm[gemm_dtype]
    qkv_a = gemm_seconds(dev, g, tokens, d.q_lora_rank + d.kv_lora_rank + d.qk_rope_head_dim,
                         d.hidden, gemm_dtype)
    q_b = gemm_seconds(dev, g, tokens, num_heads * (d.qk_nope_head_dim + d.qk_rope_head_dim),
                       d.q_lora_rank, gemm_dtype)
    o = gemm_seconds(dev, g, tokens, d.hidden, num_heads * d.v_head_dim, gemm_dtype)
    return qkv_a + q_b + o


def mla_decode_module_seconds(dev: Device, params: CostModelParams, batch, context, num_heads,
                              query_len, d: MlaDims, kv_bytes: float, kv_dtype: str,
                              gemm_dtype: str) -> np.ndarray:
    tokens = batch * query_len
    bf16 = params.gemm["bf16"]  # absorbed W_UK / W_UV stay bf16 even in fp8 checkpoints
    w_uk = batched_gemm_seconds(dev, bf16, num_heads, tokens, d.kv_lora_rank,
                                d.qk_nope_head_dim, "bf16")
    w_uv = batched_gemm_seconds(dev, bf16, num_heads, tokens, d.v_head_dim, d.kv_lora_rank,
                                "bf16")
    core = absorbed_core_seconds(dev, params.mla, batch, query_len, context, num_heads,
                                 d.kv_lora_rank, d.qk_rope_head_dim, kv_bytes, kv_dtype)
    small = params.mla.decode_overhead_s + tokens * params.mla.token_bytes / dev.hbm_bandwidth
    projections = _projections_in(dev, params, tokens, num_heads, d, gemm_dtype)
    return small + projections + w_uk + w_uv + core


def mla_prefill_core_seconds(dev: Device, params: CostModelParams, batch, new_tokens, prefix,
                             num_heads, qk_nope_head_dim, qk_rope_head_dim,
                             v_head_dim) -> np.ndarray:
    """MHA-style prefill over the up-projected K/V (bf16, built on the fly from the latent).
    FA3's physics, with its own fitted efficiency on these wider (192/128) heads."""
    fa3 = dataclasses.replace(params.prefill_attention, compute_eff=params.mla.prefill_compute_eff)
    return prefill_core_seconds(dev, fa3, batch, new_tokens, prefix,
                                num_heads, num_heads, qk_nope_head_dim + qk_rope_head_dim,
                                v_head_dim, 2.0, 1.0)


def mla_prefill_module_seconds(dev: Device, params: CostModelParams, batch, new_tokens, prefix,
                               num_heads, d: MlaDims, kv_bytes: float, kv_dtype: str,
                               gemm_dtype: str) -> np.ndarray:
    tokens = batch * new_tokens
    kv_b = gemm_seconds(dev, params.gemm[gemm_dtype], batch * (new_tokens + prefix),
                        num_heads * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank,
                        gemm_dtype)
    core = mla_prefill_core_seconds(dev, params, batch, new_tokens, prefix, num_heads,
                                    d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim)
    small = params.mla.prefill_overhead_s + tokens * params.mla.token_bytes / dev.hbm_bandwidth
    mha = small + _projections_in(dev, params, tokens, num_heads, d, gemm_dtype) + kv_b + core
    absorbed = mla_decode_module_seconds(dev, params, batch, prefix, num_heads, new_tokens, d,
                                         kv_bytes, kv_dtype, gemm_dtype)
    return np.where(new_tokens <= ABSORBED_PREFILL_MAX_TOKENS[kv_dtype], absorbed, mha)
