"""How much KV a deployment holds: blocks per DP rank, and the capacity tool.

vLLM profiles a GPU, subtracts weights and peak activations from
``gpu_memory_utilization * memory``, and turns the rest into KV blocks. We do the same
arithmetic from specs, per GPU, with `Placement` saying what each GPU holds: its
weights, an activation reserve, the temporary buffers its layout needs while a layer
runs (PCPxDCP's gathered KV, KVPP's broadcast layer), the linear-attention state of
`max_num_seqs` sequences — and what remains, divided by what a token's KV costs on
that GPU, is how many tokens the replica's cache holds.

`capacity(...)` answers the question for one request length (`labkit capacity`);
`capacity_table(...)` compares layouts side by side for a notebook.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.engine.layouts import Placement
from labkit.engine.kv.packing import block_layout
from labkit.engine.kv.sliding_window import check_sliding_window
from labkit.errors import ConfigError
from labkit.specs import EngineConfig, Layout, get_hardware, get_model

GIB = 1 << 30
ACTIVATION_RESERVE_BYTES = 2 * GIB  # CUDA graphs, workspace, fragmentation
ACTIVATION_BYTES_PER_BATCHED_TOKEN = 64 * 1024  # peak activations per scheduled token


@dataclass(frozen=True, slots=True)
class KVCapacity:
    placement: Placement
    weights_bytes_per_gpu: float
    kv_bytes_per_token_per_gpu: float
    available_bytes_per_gpu: float  # for persistent KV
    num_blocks: int  # per DP rank
    block_size: int

    @property
    def tokens_per_rank(self) -> int:
        return self.num_blocks * self.block_size


def placement_for(model, layout, config: EngineConfig) -> Placement:
    """Who holds what under `config`'s KV dtype, DCP interleave, drafts and EPLB."""
    return Placement(model, layout, config.kv_dtype(), config.dcp_kv_cache_interleave_size,
                     include_mtp=config.num_speculative_tokens > 0,
                     redundant_experts=config.num_redundant_experts if config.enable_eplb else 0)


def memory_budget(placement: Placement, hardware, config: EngineConfig,
                  temporary_tokens: int = 0) -> float:
    """Bytes per GPU left for persistent KV after weights, reserve, temporaries, state."""
    reserve = (ACTIVATION_RESERVE_BYTES
               + ACTIVATION_BYTES_PER_BATCHED_TOKEN * config.max_num_batched_tokens)
    states = config.max_num_seqs * placement.state_bytes_per_gpu()
    temporary = placement.temporary_kv_bytes_per_gpu(temporary_tokens)
    budget = hardware.hbm_bytes * config.gpu_memory_utilization
    return budget - placement.weights_bytes_per_gpu() - reserve - states - temporary


def kv_capacity(model, hardware, layout, config: EngineConfig, block_size: int,
                max_request_tokens: int = 0) -> KVCapacity:
    """KV blocks per DP rank; raises ConfigError if the weights leave no room."""
    placement = placement_for(model, layout, config)
    per_token = placement.kv_bytes_per_token_per_gpu()
    available = memory_budget(placement, hardware, config, max_request_tokens)
    if config.num_gpu_blocks_override is not None:
        blocks = config.num_gpu_blocks_override
    else:
        blocks = int(available // (per_token * block_size)) if per_token else 0
        if blocks < 1:
            raise ConfigError(
                f"{model.name} does not fit on {hardware.name} with layout {layout.text!r}: "
                f"{placement.weights_bytes_per_gpu() / GIB:.1f} GiB of weights per GPU leave "
                f"{available / GIB:.1f} GiB for KV at gpu_memory_utilization="
                f"{config.gpu_memory_utilization}; use more GPUs (tp, ep, pp), fp8, or a "
                f"layout that shards KV (dcp)"
            )
    return KVCapacity(placement, placement.weights_bytes_per_gpu(), per_token, available,
                      blocks, block_size)


def capacity(model, layout, hardware="h200", context: int = 131072, kv_dtype: str = "bf16",
             gpu_memory_utilization: float = 0.9, **knobs) -> dict:
    """What one request of `context` tokens costs under a layout, and how many fit."""
    model, hardware, layout = get_model(model), get_hardware(hardware), Layout.parse(layout)
    if context < 1:
        raise ConfigError(f"context={context} must be a positive number of tokens")
    config = EngineConfig.from_knobs(kv_cache_dtype=kv_dtype,
                                     gpu_memory_utilization=gpu_memory_utilization, **knobs)
    check_sliding_window(model, layout, config)
    placement = placement_for(model, layout, config)
    available = memory_budget(placement, hardware, config, context)
    per_token = placement.kv_bytes_per_token_per_gpu()
    tokens = max(0, int(available // per_token)) if per_token else 0
    block = config.block_size or model.block_size
    # blocks of the full-attention layers, plus pages of the sliding-window layers for
    # the blocks a request still holds at the end (its last `sliding_window` tokens)
    window_blocks = -(-context // block) - max(0, context - model.sliding_window + 1) // block
    per_request = -(-context // block) + placement.window_pages_per_block() * window_blocks
    per_rank = (tokens // block) // per_request if tokens else 0
    concurrent = min(per_rank, config.max_num_seqs) * layout.num_dp_ranks
    packing = block_layout(placement, block, config.kv_layout)
    return {
        "model": model.name, "layout": layout.text, "hardware": hardware.name,
        "context": context, "kv_dtype": config.kv_dtype(),
        "gpus": layout.gpus,
        "weights_bytes_per_gpu": placement.weights_bytes_per_gpu(),
        "kv_bytes_per_token": placement.kv_bytes_per_token(),
        "kv_bytes_per_token_per_gpu": per_token,
        "kv_replication": placement.kv_replication(),
        "persistent_kv_bytes_per_gpu": placement.persistent_kv_bytes_per_gpu(context),
        "temporary_kv_bytes_per_gpu": placement.temporary_kv_bytes_per_gpu(context),
        "kv_capacity_tokens_per_gpu": tokens,
        "max_concurrent_requests": concurrent,
        "fits": concurrent >= 1,
        "kv_layout": packing.kind,
        "kv_block_bytes_per_gpu": packing.block_bytes,
        "kv_descriptors_per_block": packing.descriptors_per_block,
    }


def capacity_table(model, layouts, hardware="h200", context: int = 131072, **kw):
    """One row per layout (a pandas DataFrame), sizes in GiB, for notebooks."""
    import pandas as pd

    rows = []
    for layout in layouts:
        r = capacity(model, layout, hardware, context, **kw)
        rows.append({
            "layout": r["layout"], "gpus": r["gpus"],
            "weights_gib_per_gpu": r["weights_bytes_per_gpu"] / GIB,
            "kv_copies": r["kv_replication"],
            "persistent_kv_gib_per_gpu": r["persistent_kv_bytes_per_gpu"] / GIB,
            "temporary_kv_gib_per_gpu": r["temporary_kv_bytes_per_gpu"] / GIB,
            "kv_capacity_tokens_per_gpu": r["kv_capacity_tokens_per_gpu"],
            "max_concurrent_requests": r["max_concurrent_requests"], "fits": r["fits"],
        })
    return pd.DataFrame(rows)
