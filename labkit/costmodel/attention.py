"""Paged attention over a GQA KV cache (FlashAttention-3, vLLM's default on Hopper).

Decode (one query token per sequence) is a stream of the KV cache through HBM:
`batch * context * kv_heads * head_dim * 2 (K and V)` elements. FA3 packs the query
heads that share a KV head into one work unit and splits long contexts across SMs, so
its time is

    launch + smooth_max(KV bytes / (HBM bw * memory_eff) * kv_factor,
                        units * unit_s * head_dim/128 / SMs)

where a *unit* is one (sequence, KV head) pair: each costs a fixed `unit_s` of one SM
(set up, load Q, merge split partials, write O), more for wider heads. With many short
sequences the units dominate; with long contexts the bytes do. An fp8 KV cache halves
the bytes but dequantizes on the fly, so each of its bytes costs `fp8_kv_factor` more.

Prefill (many new tokens, causal, after `prefix` cached tokens) is compute:
`4 * heads * head_dim * pairs` FLOPs for QK^T and PV, where `pairs` counts the causal
(query, key) pairs. Softmax (exp on the special-function units) is paid per pair and
per head, whatever the head dim; `softmax_dims` expresses it as extra head dims of MMA
work, which is why small heads run further from peak. One thread block owns a 128-row
query tile and must visit every key before it, so the last tile of a long sequence
bounds the time when there are few tiles (`longest` below). With an fp8 cache the
compute runs `fp8_kv_factor` slower (dequantization in the inner loop). Memory: read
K/V and Q, write O, and write the new K/V into the paged cache; the fit puts its HBM
efficiency at only ~0.3, i.e. these bytes (mostly Q and O when few tokens are new) cost
~3x a plain stream, which the model takes as measured without explaining it. A
(sequence, KV head) unit cost as in decode completes it. Kernel: vllm_flash_attn_fa3.
"""

from __future__ import annotations

import numpy as np
from numba.extending import register_jitable

from labkit.costmodel.curves import causal_pairs, smooth_max
from labkit.costmodel.device import Device
from labkit.costmodel.params import DecodeAttentionParams, PrefillAttentionParams

Q_TILE = 128  # FA3's query rows per thread block on Hopper


def kv_factor(kv_dtype: str, fp8_factor: float) -> float:
    return fp8_factor if kv_dtype == "fp8" else 1.0


def attention_decode_seconds(dev: Device, p: DecodeAttentionParams, batch, context, num_heads,
                             num_kv_heads, head_dim, kv_bytes: float,
                             kv_dtype: str) -> np.ndarray:
    return decode_seconds(batch, context, num_heads, num_kv_heads, head_dim, kv_bytes,
                          kv_factor(kv_dtype, p.fp8_kv_factor),
                          dev.hbm_bandwidth * p.memory_eff, dev.sms, p.unit_s, p.launch_s)


@register_jitable  # (a plain function; the engine's compiled rows call it too)
def decode_seconds(batch, context, num_heads, num_kv_heads, head_dim, kv_bytes, fp8_factor,
                   hbm_rate, sms, unit_s, launch_s):
    """`attention_decode_seconds` on numbers: `fp8_factor` the KV bytes' factor
    (`kv_factor`), `hbm_rate` the HBM bandwidth times its efficiency."""
    attended = context + 1.0  # the new token attends to itself too
    kv = batch * attended * num_kv_heads * head_dim * 2.0 * kv_bytes
    q_and_o = batch * num_heads * head_dim * 2.0 * 2.0
    memory = (kv * fp8_factor + q_and_o) / hbm_rate
    units = batch * num_kv_heads * unit_s * (head_dim / 128.0) / sms
    return launch_s + smooth_max(memory, units)


def prefill_core_seconds(dev: Device, p: PrefillAttentionParams, batch, new_tokens, prefix,
                         num_heads, num_kv_heads, qk_dim, v_dim, kv_bytes: float,
                         fp8_factor: float) -> np.ndarray:
    """Causal prefill attention with separate QK and V head dims (MLA prefill has 192/128)."""
    return prefill_seconds(batch, new_tokens, prefix, num_heads, num_kv_heads, qk_dim, v_dim,
                           kv_bytes, fp8_factor, dev.flops("bf16") * p.compute_eff, dev.sms,
                           p.softmax_dims, dev.hbm_bandwidth * p.memory_eff, p.unit_s,
                           p.launch_s)


@register_jitable  # (a plain function; the engine's compiled rows call it too)
def prefill_seconds(batch, new_tokens, prefix, num_heads, num_kv_heads, qk_dim, v_dim,
                    kv_bytes, fp8_factor, rate, sms, softmax_dims, hbm_rate, unit_s, launch_s):
    """`prefill_core_seconds` on numbers: `rate` the bf16 peak times the MMAs'
    efficiency, `hbm_rate` the HBM bandwidth times its efficiency."""
    pair_flops = 2.0 * (qk_dim + v_dim + 2.0 * softmax_dims)  # per (query, key, head)
    total = batch * num_heads * causal_pairs(new_tokens, prefix) * pair_flops / rate
    # the last query tile of a sequence attends to all keys; it runs on one SM
    tile_rows = np.minimum(new_tokens, Q_TILE)
    longest = tile_rows * (prefix + new_tokens) * pair_flops / (rate / sms)
    compute = smooth_max(total, longest) * fp8_factor
    head_dim = (qk_dim + v_dim) * 0.5
    kv_read = batch * (prefix + new_tokens) * num_kv_heads * head_dim * 2.0 * kv_bytes
    kv_write = batch * new_tokens * num_kv_heads * head_dim * 2.0 * 2.0
    q_and_o = batch * new_tokens * num_heads * head_dim * 2.0 * 2.0
    memory = (kv_read + kv_write + q_and_o) / hbm_rate
    units = batch * num_kv_heads * unit_s * (head_dim / 128.0) / sms
    return launch_s + smooth_max(compute, memory, units)


def attention_prefill_seconds(dev: Device, p: PrefillAttentionParams, batch, new_tokens, prefix,
                              num_heads, num_kv_heads, head_dim, kv_bytes: float,
                              kv_dtype: str) -> np.ndarray:
    return prefill_core_seconds(dev, p, batch, new_tokens, prefix, num_heads, num_kv_heads,
                                head_dim, head_dim, kv_bytes, kv_factor(kv_dtype, p.fp8_kv_factor))
