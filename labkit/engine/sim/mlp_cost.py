"""MLP pricing: what a layer's feed-forward part, the LM head and the drafts cost a GPU.

The step model (`layer_model.py`) walks a stage's layers; besides attention
(`attention_cost.py`) each layer has a feed-forward part, and the step ends with the
LM head. All of it sees only token counts:

- **dense MLP**: the gate/up and down GEMMs, their width split over TP, then a TP
  all-reduce;
- **MoE**: the fused kernel on the busiest GPU of its expert group — under expert
  parallelism its share of the routed rows comes from the routing distribution
  (`costmodel/routing.py`, the knob `moe_routing`), EPLB's replicas included — plus
  shared experts and the router, then the placement's collectives (EP's all-to-all);
- **linear-attention layers** (KDA): projections, the chunked delta rule over a
  prefill's tokens, a memory-bound read-modify-write of each decoding sequence's state;
- the **LM head** over the rows a step samples, and each **MTP draft**: one more pass of
  the MTP layer and the LM head.
"""

from __future__ import annotations

import numpy as np

from labkit.costmodel.routing import factor_curve
from labkit.engine.layouts import Placement

STATE_HBM_EFFICIENCY = 0.7  # linear-attention state updates: strided reads and writes


class MlpCost:
    def __init__(self, placement: Placement, ops, wdtype: str, drafts: int,
                 moe_routing: str, seed: int) -> None:
        """`ops`: the calibrated kernels (`CostModel`); `wdtype`: the GEMMs' weight
        dtype; `drafts`: speculative tokens per decoding request."""
        self.placement = placement
        self.model = m = placement.model
        self.layout = lay = placement.layout
        self.ops = ops
        self.wdtype = self.moe_dtype = wdtype
        self.drafts = drafts
        self.has_drafts = bool(drafts and m.num_mtp_modules)
        self.moe_routing = moe_routing
        # the busiest EP rank's load factor against routed tokens (None: always 1)
        self.moe_curve = factor_curve(m.num_experts, m.num_experts_per_tok, lay.ep, moe_routing,
                                      placement.redundant_experts, max(m.num_moe_layers, 1),
                                      seed, sampled=True) if m.is_moe else None

    def layer(self, tokens, group):
        """(dense layer, MoE layer) compute, and (dense, MoE) communication: `tokens`
        through this GPU's GEMMs, `group` the tokens its MoE kernel sees routed."""
        m, lay, ops, w = self.model, self.layout, self.ops, self.wdtype
        h, tp = m.hidden_size, lay.tp
        dense = dense_comm = 0.0  # (a model of MoE layers only sums no dense ones)
        if m.num_dense_mlp_layers:
            dense = ops.gemm(tokens, 2 * m.intermediate_size / tp, h, w)
            dense = dense + ops.gemm(tokens, h, m.intermediate_size / tp, w)
            dense_comm = priced_collectives(ops, _tp_allreduce(self.placement, tokens))
        if not m.is_moe:
            return (dense, 0.0), (dense_comm, 0.0)
        # the kernel sees every token the expert group routes (num_tokens across EP);
        # under EP every rank waits for the busiest (the routing distribution's share)
        factor = 1.0 if self.moe_curve is None else \
            np.interp(np.log2(np.maximum(group, 1.0)), *self.moe_curve)
        moe = ops.moe(group, h, m.moe_intermediate_size, m.num_experts_per_tok, m.num_experts,
                      ep_size=lay.ep, tp_size=1 if lay.ep > 1 else tp, dtype=self.moe_dtype,
                      distribution=self.moe_routing, load_factor=factor)
        shared = m.num_shared_experts * m.moe_intermediate_size / tp
        if shared:
            moe = moe + ops.gemm(tokens, 2 * shared, h, w) + ops.gemm(tokens, h, shared, w)
        moe = moe + ops.gemm(tokens, m.num_experts, h, "bf16")  # router
        moe_comm = priced_collectives(ops, self.placement.moe_comm(tokens))
        return (dense, moe), (dense_comm, moe_comm)

    def linear_layer(self, tokens, prefill_tokens, num_decode_reqs):
        m = self.model
        if not m.linear_layers:
            return 0.0
        ops, w, lay = self.ops, self.wdtype, self.layout
        heads, dim = m.linear_num_heads / lay.tp, m.linear_head_dim
        proj = ops.gemm(tokens, 4 * heads * dim, m.hidden_size, w)
        # prefill: chunked delta rule, ~ two (dim x dim) products per token per head
        chunk = ops.gemm(prefill_tokens / lay.pcp * heads, dim, dim, "bf16") * 2
        state = heads * dim * dim * 4  # fp32 state per sequence per layer
        hbm = self.ops.hardware.hbm_bandwidth * STATE_HBM_EFFICIENCY
        decode = num_decode_reqs * 2 * state / hbm
        return proj + chunk + decode

    def lm_head(self, rows):
        m = self.model
        return self.ops.gemm(rows, m.vocab_size / self.layout.tp, m.hidden_size, "bf16")

    def draft_passes(self, decode_reqs):
        """MTP: each draft token is one more pass of the MTP layer and the LM head."""
        if not self.has_drafts:
            return 0.0
        m, w = self.model, self.wdtype
        rows = np.maximum(decode_reqs, 1)
        layer = self.ops.gemm(rows, m.hidden_size, 2 * m.hidden_size, w)
        if m.is_moe:
            layer = layer + self.ops.moe(rows, m.hidden_size, m.moe_intermediate_size,
                                         m.num_experts_per_tok, m.num_experts,
                                         dtype=self.moe_dtype, distribution=self.moe_routing,
                                         load_factor=1.0)
        per_draft = layer + self.lm_head(rows)
        return np.where(decode_reqs > 0, self.drafts * per_draft, 0.0)


def priced_collectives(ops, ops_by_name: dict):
    """Seconds of a layer's collectives ({name: (op, bytes, GPUs)}), added in order."""
    total = 0.0
    for op, nbytes, n in ops_by_name.values():
        total = total + ops.collective(op, nbytes, n)
    return total


def _tp_allreduce(placement: Placement, tokens) -> dict:
    lay = placement.layout
    if lay.tp == 1:
        return {}
    nbytes = tokens * placement.model.hidden_size * 2
    return {"tp_allreduce": ("all_reduce", nbytes, lay.tp)}
