"""How many KV blocks a DP rank gets.

vLLM profiles a GPU, subtracts weights and peak activations from
``gpu_memory_utilization * memory``, and turns the rest into KV blocks. We do the same
arithmetic from specs: per GPU of a DP rank, its share of the weights (TP and PP split
the dense weights; EP, or else TP, splits the experts), an activation reserve, the
fixed-size state of linear-attention layers for `max_num_seqs` sequences, and what
remains divided by one block's bytes on that GPU. A block holds `block_size` tokens
of every full-attention layer the GPU serves: under TP, GQA KV heads are split (but
never below one head per GPU) while an MLA latent is replicated; DCP shards tokens.

The layouts issue refines placement (PCP copies, KVPP, temporary buffers); this
module answers "how many blocks" for the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.errors import ConfigError
from labkit.specs.dtypes import dtype_bytes

GIB = 1 << 30
ACTIVATION_RESERVE_BYTES = 2 * GIB  # CUDA graphs, workspace, fragmentation
ACTIVATION_BYTES_PER_BATCHED_TOKEN = 64 * 1024  # peak activations per scheduled token


@dataclass(frozen=True, slots=True)
class KVCapacity:
    weights_bytes_per_gpu: float
    kv_bytes_per_token_per_gpu: float  # all of the GPU's layers
    kv_bytes_per_block_per_gpu: float
    available_bytes_per_gpu: float
    num_blocks: int  # per DP rank


def weights_bytes_per_gpu(model, layout) -> float:
    w = dtype_bytes(model.weight_dtype)
    routed = model.num_moe_layers * model.num_experts * model.expert_params()
    dense = model.total_params() - routed - model.embedding_params()
    dense_bytes = dense * w + model.embedding_params() * dtype_bytes("bf16")
    expert_shards = layout.ep if layout.ep > 1 else layout.tp
    expert_bytes = routed * w / expert_shards
    return (dense_bytes / layout.tp + expert_bytes) / layout.pp


def kv_bytes_per_token_per_gpu(model, layout, kv_dtype: str) -> float:
    per_token = model.kv_bytes_per_token(kv_dtype)
    if not model.is_mla:
        heads_per_gpu = max(1, model.num_kv_heads // layout.tp)
        per_token = per_token * heads_per_gpu / model.num_kv_heads
    return per_token / layout.pp / layout.dcp


def kv_capacity(model, hardware, layout, config, block_size: int) -> KVCapacity:
    weights = weights_bytes_per_gpu(model, layout)
    per_token = kv_bytes_per_token_per_gpu(model, layout, config.kv_dtype())
    per_block = per_token * block_size
    reserve = (ACTIVATION_RESERVE_BYTES
               + ACTIVATION_BYTES_PER_BATCHED_TOKEN * config.max_num_batched_tokens)
    states = config.max_num_seqs * model.linear_state_bytes_per_sequence() / layout.tp
    budget = hardware.hbm_bytes * config.gpu_memory_utilization
    available = budget - weights - reserve - states
    if config.num_gpu_blocks_override is not None:
        return KVCapacity(weights, per_token, per_block, available,
                          config.num_gpu_blocks_override)
    if available < per_block:
        raise ConfigError(
            f"{model.name} does not fit on {hardware.name} with layout {layout.text!r}: "
            f"{weights / GIB:.1f} GiB of weights per GPU leave {available / GIB:.1f} GiB "
            f"for KV (of {budget / GIB:.1f} GiB at gpu_memory_utilization="
            f"{config.gpu_memory_utilization}); use more GPUs (tp, ep, pp) or fp8"
        )
    return KVCapacity(weights, per_token, per_block, available, int(available // per_block))
