"""DeepSeek sparse attention (DSA, DeepSeek-V3.2): an indexer picks, attention gathers.

Neither op has measurements in the calibration data, so both are *derived* from
constants fitted on ops that share their physics; nothing here is fitted.

**Indexer.** For every new token, `index_num_heads` fp8 dot products of
`index_head_dim` against the index key of every earlier token (causal), a ReLU and a
weighted sum over heads give one score per key; a top-k then keeps the best keys.
vLLM runs the scores with DeepGEMM's fp8 kernels, so they are priced with the
fp8_block GEMM's constants: 2 * heads * dim FLOPs per (query, key) pair at its fitted
fraction of fp8 peak; memory, the fp8 index keys (+ a 4-byte scale each) read once per
sequence and the fp32 scores written and read back by the top-k, at its HBM
efficiency; and two kernel launches. It is linear in the context per decode token and
quadratic for a whole prefill, which is what makes it dominate long prefills.

**Sparse attention.** Each query attends `topk` latent entries gathered from the MLA
cache (absorbed, like MLA decode). Different queries pick different entries, so the
gather is priced per query: `topk * 576` elements per query token, a memory-bound
stream at the MLA core's fitted bandwidth efficiency, plus the same per-unit and launch
costs as the MLA decode core. Compute is MLA's 2 * heads * (576 + 512) per pair. The
sparse kernel (FlashMLA sparse) is assumed to reach the dense one's efficiencies.
"""

from __future__ import annotations

import numpy as np

from labkit.costmodel.curves import causal_pairs, ceil_div, smooth_max
from labkit.costmodel.device import Device
from labkit.costmodel.mla import HEAD_TILE
from labkit.costmodel.params import CostModelParams


def sparse_attention_seconds(dev: Device, params: CostModelParams, batch, new_tokens, topk,
                             num_heads, kv_lora_rank, qk_rope_head_dim, kv_bytes: float,
                             kv_dtype: str) -> np.ndarray:
    p = params.mla
    latent = kv_lora_rank + qk_rope_head_dim
    queries = batch * new_tokens
    compute = (queries * num_heads * topk * 2.0 * (latent + kv_lora_rank)
               / (dev.flops("bf16") * p.compute_eff))
    fp8 = p.fp8_kv_factor if kv_dtype == "fp8" else 1.0
    gathered = queries * topk * latent * kv_bytes * fp8
    q_and_o = queries * num_heads * (latent + kv_lora_rank) * 2.0
    memory = (gathered + q_and_o) / (dev.hbm_bandwidth * p.memory_eff)
    units = queries * ceil_div(num_heads, HEAD_TILE) * p.unit_s / dev.sms
    return p.launch_s + smooth_max(compute, memory, units)


def indexer_seconds(dev: Device, params: CostModelParams, batch, new_tokens, context,
                    index_num_heads, index_head_dim) -> np.ndarray:
    g = params.gemm["fp8_block"]
    pairs = batch * causal_pairs(new_tokens, context)
    compute = (pairs * index_num_heads * 2.0 * index_head_dim
               / (dev.flops("fp8") * g.compute_eff))
    keys = batch * (context + new_tokens) * (index_head_dim + 4.0)  # fp8 key + fp32 scale
    scores = pairs * 4.0 * 2.0  # fp32 scores written, then read by the top-k
    memory = (keys + scores) / (dev.hbm_bandwidth * g.memory_eff)
    # two kernels (scores, top-k), each with the GEMM launch latency
    return 2.0 * g.launch_s + smooth_max(compute, memory)
