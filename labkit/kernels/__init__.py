"""Attention and KV-cache kernels on the paged cache: Triton on CUDA, torch references elsewhere.

Public functions (all check shapes, dtypes and devices first and raise
`KernelArgumentError`, a ValueError naming the argument and what was expected):

    paged_decode_attention(q[B,Hq,D], k_cache[NB,BS,Hkv,D], v_cache[NB,BS,Hkv,D],
                           block_table[B,MAXB] int32, seq_lens[B] int32, scale, window=0)
        -> out[B,Hq,D], lse[B,Hq]
    mla_paged_decode(q_latent[B,H,Dl+Dr] | [B,Q,H,Dl+Dr], latent_cache[NB,BS,Dl+Dr],
                     block_table, seq_lens, scale, kv_lora_rank=512)
        -> out[B,(Q,)H,Dl], lse[B,(Q,)H]
    merge_attn_states(outs[N,B,H,D], lses[N,B,H]) -> out[B,H,D], lse[B,H]
    reshape_and_cache(k[T,Hkv,D], v[T,Hkv,D], k_cache, v_cache, slot_mapping[T] int64)
    reshape_and_cache_latent(latent[T,Dc], latent_cache[NB,BS,Dc], slot_mapping[T])
    paged_prefill_attention(q[T,Hq,D], k_new[T,Hkv,D], v_new[T,Hkv,D], k_cache, v_cache,
                            block_table[B,MAXB], prefix_lens[B], query_start_loc[B+1], scale,
                            window=0)
        -> out[T,Hq,D], lse[T,Hq]
    sparse_topk_attention(q[T,H,Dl+Dr], latent_cache[NB,BS,Dl+Dr], topk_indices[T,K] int32,
                          block_table[B,MAXB], token_to_req[T] int32, scale, kv_lora_rank=512)
        -> out[T,H,Dl], lse[T,H]

Conventions shared by all:
- dtypes: float32, bfloat16, float16 (one dtype per call); tables, lengths and indices
  int32 (slot_mapping int32 or int64). Accumulation in float32; outputs in the query's
  dtype, `lse` always float32, the **natural-log** log-sum-exp of the *scaled* scores.
- paged cache: position t of a request is slot t % BS of physical block
  block_table[b, t // BS]; several requests may point at the same physical blocks
  (prefix sharing, forks), and entries past a request's length are never read.
- sliding window (`window=W` > 0, GQA decode and prefill): a query at position p sees
  positions p-W+1..p only; table entries of blocks wholly before the first query's
  window are never read (the KV manager frees those blocks: -1 there is fine).
- nothing to attend (seq_len 0: an empty DCP shard; all top-k padding) gives out = 0,
  lse = -inf, never NaN; `merge_attn_states` treats such partials as empty.
- caches may be strided views (e.g. K and V interleaved in one packed buffer) as long as
  their last dim is contiguous; other inputs are made contiguous if needed.
- value checks (lengths within the table, block ids within the cache, slots within
  the cache) run on CPU tensors only: on CUDA they would sync the device every layer.

Backend: CUDA tensors run Triton, CPU tensors the torch reference (`reference.py`);
LABKIT_KERNELS=triton|torch|auto overrides (see `dispatch`). `last_backend[name]` and
`dispatch_counts[(name, backend)]` record what ran. The Triton kernels are described in
`triton_impl`; `labkit.kernels.bench.bench_kernels()` times them on a GPU.
"""

from labkit.kernels._checks import KernelArgumentError
from labkit.kernels.api import (
    merge_attn_states, mla_paged_decode, paged_decode_attention, paged_prefill_attention,
    reshape_and_cache, reshape_and_cache_latent, sparse_topk_attention,
)
from labkit.kernels.dispatch import dispatch_counts, last_backend

__all__ = [
    "KernelArgumentError", "dispatch_counts", "last_backend", "merge_attn_states",
    "mla_paged_decode", "paged_decode_attention", "paged_prefill_attention",
    "reshape_and_cache", "reshape_and_cache_latent", "sparse_topk_attention",
]
