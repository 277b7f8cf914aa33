"""A first-order (roofline) cost model of one engine step.

Each GPU of a DP rank must, per step, stream its share of the weights and of the KV
cache through HBM and perform its share of the FLOPs. On a GPU those overlap, so a
step takes about

    max(FLOPs / achieved FLOP/s,  bytes / achieved bandwidth) + communication + overhead

where the achieved rates are fixed fractions of the datasheet peaks, communication is
the layout's collectives (TP all-reduces, EP all-to-alls) as latency + bytes /
bandwidth, and the overhead is what a step costs even when empty (scheduling, launch,
synchronisation). MoE layers read only the experts some token selected: with S routed
selections over E experts, E·(1 - (1 - 1/E)^S) distinct experts in expectation.

This is the model issue 2 needs (step times of the right order, responding to batch,
context and layout); the calibrated, layout-exact model replaces it behind the same
`CostModel` interface. Everything here is +, *, / and table lookups on numpy arrays,
so a step computed alone and the same step inside a fast-forwarded run give
bit-identical times.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from labkit.engine.step_work import StepTiming, StepWork
from labkit.specs.dtypes import dtype_bytes
from labkit.specs.hardware import HardwareSpec
from labkit.specs.layout import Layout
from labkit.specs.models import ModelSpec


@dataclass(slots=True)
class RooflineParams:
    gemm_efficiency: float = 0.75  # achieved / peak FLOP/s (H200 BF16 GEMM ~ 790/989)
    hbm_efficiency: float = 0.85  # achieved / peak HBM bandwidth
    link_efficiency: float = 0.80  # achieved / peak NVLink or NIC bandwidth
    step_overhead_s: float = 1.0e-3  # scheduling + launch, per step
    layer_overhead_s: float = 8e-6  # per layer per step (small kernels, syncs)
    collective_latency_s: float = 10e-6  # per collective


class RooflineCostModel:
    def __init__(self, model: ModelSpec, hardware: HardwareSpec, layout: Layout,
                 kv_dtype: str = "bf16", params: RooflineParams | None = None) -> None:
        self.model, self.hardware, self.layout = model, hardware, layout
        self.params = p = params or RooflineParams()
        m, hw, lay = model, hardware, layout
        tp = lay.tp
        w_bytes = dtype_bytes(m.weight_dtype)

        routed = m.num_moe_layers * m.num_experts * m.expert_params()
        dense_params = m.total_params() - routed - m.embedding_params()
        lm_head = m.vocab_size * m.hidden_size
        # Per GPU, per step: dense weights are read whole; TP splits them.
        self.dense_bytes = (dense_params * w_bytes + lm_head * 2) / tp
        self.dense_flops_per_token = 2 * dense_params / tp
        self.lm_head_flops_per_row = 2 * lm_head / tp

        # Experts: over EP ranks whole experts; otherwise TP slices every expert.
        self.ep = lay.ep
        self.expert_shards = lay.ep if lay.ep > 1 else tp
        self.expert_bytes = m.expert_params() * w_bytes
        self.expert_flops = 2 * m.expert_params()
        self.moe_layers = m.num_moe_layers
        self.topk = m.num_experts_per_tok
        self._distinct = _distinct_expert_table(m.num_experts) if m.is_moe else None

        # KV: GQA heads split over TP (replicated past kv_heads); MLA latent replicated.
        kv_per_token = m.kv_bytes_per_token(kv_dtype)
        if m.is_mla:
            kv_split = 1
        else:
            kv_split = min(tp, m.num_kv_heads)
        self.kv_bytes_per_token = kv_per_token / kv_split / lay.dcp
        self.state_bytes = m.linear_state_bytes_per_sequence() / tp

        heads = m.num_heads / tp
        layers = m.num_full_attention_layers
        if m.is_mla:  # decode runs absorbed (latent space), prefill runs as MHA
            decode_dims = (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
            prefill_dims = m.qk_head_dim + m.v_head_dim
        else:
            decode_dims = prefill_dims = 2 * m.head_dim
        self.decode_pair_flops = 2 * heads * decode_dims * layers / lay.dcp
        self.prefill_pair_flops = 2 * heads * prefill_dims * layers / lay.dcp
        # sliding-window layers: each query reads at most `window` keys
        self.window = m.sliding_window
        self.window_pair_flops = 2 * heads * 2 * m.head_dim * m.num_sliding_layers
        self.window_kv_bytes_per_token = m.sliding_kv_bytes_per_token(kv_dtype) / kv_split
        if m.has_indexer:
            index = 2 * m.index_num_heads * m.index_head_dim * layers
            self.decode_pair_flops += index
            self.prefill_pair_flops += index

        self.gemm_rate = hw.flops(m.weight_dtype) * p.gemm_efficiency
        self.attn_rate = hw.flops("bf16") * p.gemm_efficiency
        self.hbm_rate = hw.hbm_bandwidth * p.hbm_efficiency
        self.overhead = p.step_overhead_s + p.layer_overhead_s * m.num_layers
        self._setup_comm()

    def _setup_comm(self) -> None:
        m, hw, lay, p = self.model, self.hardware, self.layout, self.params
        tp = lay.tp
        self.allreduce_s_per_token = 0.0
        self.allreduce_latency = 0.0
        if tp > 1:
            link = hw.nvlink_bandwidth if tp <= hw.gpus_per_node else hw.internode_bandwidth
            per_token = 2 * (tp - 1) / tp * m.hidden_size * 2 / (link * p.link_efficiency)
            collectives = 2 * m.num_layers
            self.allreduce_s_per_token = collectives * per_token
            self.allreduce_latency = collectives * p.collective_latency_s
        self.a2a_s_per_token = 0.0
        self.a2a_latency = 0.0
        if lay.ep > 1:
            span = lay.ep * (lay.tp if not lay.lockstep else 1)
            link = hw.nvlink_bandwidth if span <= hw.gpus_per_node else hw.internode_bandwidth
            # dispatch in fp8, combine in bf16, each token to top-k experts
            per_token = self.topk * m.hidden_size * 3 * (lay.ep - 1) / lay.ep
            self.a2a_s_per_token = self.moe_layers * per_token / (link * p.link_efficiency)
            self.a2a_latency = 2 * self.moe_layers * p.collective_latency_s

    @property
    def min_step_s(self) -> float:
        """No step is shorter than this (used to bound fast-forward horizons)."""
        return self.overhead

    def step_timing(self, work: StepWork, lockstep: bool) -> StepTiming:
        tokens = work.tokens
        # A lockstep rank with nothing to do still runs a one-token dummy batch.
        tokens = np.where(work.idle, 1, tokens) if lockstep else tokens
        rows = work.num_prefill_reqs + work.decode_tokens  # positions that need logits

        gemm_flops = tokens * self.dense_flops_per_token + rows * self.lm_head_flops_per_row
        weight_bytes = self.dense_bytes
        if self._distinct is not None:
            group_tokens = tokens.sum(axis=1, keepdims=True) if lockstep else tokens
            selections = np.minimum(group_tokens * self.topk, len(self._distinct) - 1)
            touched = self._distinct[selections] / self.expert_shards
            weight_bytes = weight_bytes + self.moe_layers * touched * self.expert_bytes
            gemm_flops = gemm_flops + (self.moe_layers * self.topk * self.expert_flops
                                       / self.expert_shards) * group_tokens
        attn_flops = (work.prefill_pairs * self.prefill_pair_flops
                      + work.decode_pairs * self.decode_pair_flops)
        kv_bytes = (work.kv_read_tokens * self.kv_bytes_per_token
                    + work.num_reqs * (2 * self.state_bytes))
        if self.window:
            pairs = np.minimum(work.prefill_pairs + work.decode_pairs, tokens * self.window)
            attn_flops = attn_flops + pairs * self.window_pair_flops
            read = np.minimum(work.kv_read_tokens, work.num_reqs * self.window + tokens)
            kv_bytes = kv_bytes + read * self.window_kv_bytes_per_token

        compute = gemm_flops / self.gemm_rate + attn_flops / self.attn_rate
        memory = (weight_bytes + kv_bytes) / self.hbm_rate
        comm = (tokens * (self.allreduce_s_per_token + self.a2a_s_per_token)
                + (self.allreduce_latency + self.a2a_latency))
        busy = np.maximum(compute, memory) + comm + self.overhead
        duration = busy.max(axis=1)
        return StepTiming(busy=busy, compute=np.maximum(compute, memory), comm=comm,
                          duration=duration, temporary_kv_bytes=np.zeros_like(busy))


def _distinct_expert_table(num_experts: int) -> np.ndarray:
    """Expected distinct experts hit by S uniform selections, for S = 0 .. 64 E."""
    s = np.arange(64 * num_experts + 1, dtype=np.float64)
    return num_experts * (1.0 - (1.0 - 1.0 / num_experts) ** s)
