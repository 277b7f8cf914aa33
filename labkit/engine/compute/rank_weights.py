"""Which weights a rank holds: its stage's layers, its TP slice, its experts.

Reading from a weight source (weight_source.py: the full model in memory, seeds, or a
checkpoint read piece by piece), a rank keeps the decoder layers of its
pipeline stage, the embedding if it is the first stage and the final norm and LM head
if it is the last; every tensor is cut to its TP slice (`models.sharding.tp_part`:
heads, MLP columns; MLA's latent projections, routers and the DSA indexer replicated).
Routed experts go to the EP group when there is one — whole experts, only those this
rank owns — and are TP-sliced like any MLP otherwise.
"""

from __future__ import annotations

import torch

from labkit.engine.compute.mesh import RankPlace
from labkit.engine.compute.models.sharding import WHOLE, tp_part
from labkit.engine.compute.moe_parallel import owned_experts
from labkit.engine.compute.weight_source import as_source
from labkit.specs.layout import Layout
from labkit.specs.models import ModelSpec

Tensor = torch.Tensor


def rank_weights(spec: ModelSpec, source, place: RankPlace, layout: Layout,
                 device="cpu") -> dict:
    """`{layer: its tensors (prefix stripped), "model": embedding / norm / head}`, read
    from `source` (a weight source, or a dict of the full tensors): only the tensors
    this GPU holds, and of each only its piece."""
    source = as_source(source)
    names = rank_tensor_names(spec, layout, place, source.shapes)
    out: dict = {}
    for layer in place.layers:
        prefix = f"model.layers.{layer}."
        out[layer] = {}
        for name in (n for n in names if n.startswith(prefix)):
            whole_expert = layout.ep > 1 and ".mlp.experts." in name  # EP: whole experts
            part = WHOLE if whole_expert else tp_part(spec, name, source.shapes[name],
                                                      place.tp_index, layout.tp)
            out[layer][name[len(prefix):]] = source.read(name, part).to(device)
    model = {}
    if place.first_stage:
        model["model.embed_tokens.weight"] = source.read("model.embed_tokens.weight").to(device)
    if place.last_stage:
        model["model.norm.weight"] = source.read("model.norm.weight").to(device)
        head = "lm_head.weight" if "lm_head.weight" in source.shapes \
            else "model.embed_tokens.weight"  # tied: the head is the embedding
        model["lm_head.weight"] = source.read(head).to(device)
    out["model"] = model
    return out


def rank_tensor_names(spec: ModelSpec, layout: Layout, place: RankPlace, names) -> list[str]:
    """Which of the full model's tensor `names` `rank_weights` reads for this GPU."""
    keep = (None if layout.ep == 1
            else set(owned_experts(spec.num_experts, layout.ep, place.ep_index)))
    prefixes = tuple(f"model.layers.{layer}." for layer in place.layers)
    model = ({"model.embed_tokens.weight"} if place.first_stage else set()) | \
        ({"model.norm.weight", "lm_head.weight"} if place.last_stage else set())
    if place.last_stage and "lm_head.weight" not in names:  # tied: the head is the embedding
        model.add("model.embed_tokens.weight")
    return [n for n in names
            if n in model or (n.startswith(prefixes) and (
                keep is None or ".mlp.experts." not in n or _expert_id(n) in keep))]


def _expert_id(name: str) -> int:
    return int(name.split(".mlp.experts.")[1].split(".")[0])


def kv_shapes(spec: ModelSpec, layer_weights: dict[int, dict]) -> dict[int, dict]:
    """Per attention layer, the per-token shape of each paged cache tensor."""
    shapes = {}
    for layer, w in layer_weights.items():
        if layer == "model" or spec.is_linear_layer(layer):
            continue
        if spec.is_mla:
            named = {"latent": (spec.kv_lora_rank + spec.qk_rope_head_dim,)}
            if spec.has_indexer:
                named["index_k"] = (spec.index_head_dim,)
        else:
            heads = w["self_attn.k_proj.weight"].shape[0] // spec.head_dim
            named = {"k": (heads, spec.head_dim), "v": (heads, spec.head_dim)}
        shapes[layer] = named
    return shapes
