"""A decoder forward pass as one rank runs it: its rows, its layers, its slices.

The same pre-norm decoder as `models.reference` (`x += attn(norm(x))`,
`x += mlp(norm(x))`, `logits = lm_head(norm(x))`), but rank-local: the first pipeline
stage embeds the rank's rows (under PCP, its share of the new tokens), later stages
receive hidden states from the stage before and pass theirs on; attention and MLP
outputs are TP partial sums, all-reduced; only the last stage computes logits, and
only for the rows that need them (decode rows, and the last row of a prompt chunk
that completes its prompt).
"""

from __future__ import annotations

import numpy as np
import torch

from labkit.engine.compute.attention import attention
from labkit.engine.compute.models.family import family_config
from labkit.engine.compute.models.layers import linear, rms_norm
from labkit.engine.compute.moe_parallel import mlp
from labkit.engine.compute.rank import Rank, RankStep
from labkit.engine.compute.step_batch import StepBatch


def rank_forward(rank: Rank, batch: StepBatch) -> tuple[np.ndarray, torch.Tensor] | None:
    """Run one step on `rank`; the last stage returns `(token rows, their logits)`."""
    rs = RankStep(rank, batch)
    place, model = rank.place, rank.weights["model"]
    eps = family_config(rank.spec).rms_norm_eps
    if place.first_stage:
        ids = batch.tensor(batch.token_ids[rs.rows])
        x = model["model.embed_tokens.weight"][ids]
    else:
        x = rank.pp.recv(place.stage - 1)
    for layer in place.layers:
        w = rank.weights[layer]
        h = rms_norm(x, w["input_layernorm.weight"], eps)
        x = x + rank.tp.all_reduce(attention(rs, layer, w, h))
        h = rms_norm(x, w["post_attention_layernorm.weight"], eps)
        x = x + mlp(rs, layer, w, h)
    if not place.last_stage:
        rank.pp.send(x, place.stage + 1)
        return None
    wanted = np.nonzero(np.isin(rs.rows, batch.logit_rows))[0]
    h = rms_norm(x[torch.as_tensor(wanted, device=x.device)], model["model.norm.weight"], eps)
    return rs.rows[wanted], linear(h, model["lm_head.weight"])
