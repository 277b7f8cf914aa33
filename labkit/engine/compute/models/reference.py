"""Single-device reference models: the numerical ground truth for the paged runner.

Whole sequence, causal, no KV cache, positions 0..T-1, in the weights' dtype (pass
float64 weights, or `dtype=torch.float64`, for a tight reference). Every family is a
pre-norm decoder: `x += attn(rms_norm(x))`, `x += mlp(rms_norm(x))`, then
`logits = lm_head(rms_norm(x))`. Attention per layer: GQA (llama, qwen3_moe), MLA
(naive form) with the DSA top-k mask (deepseek_v32), or KDA (kimi_linear's
`linear_layers`); gpt_oss's `sliding_window_layers` are GQA whose causal mask also
hides keys `sliding_window` or more positions back. MLP: dense SwiGLU, or MoE from
layer `first_k_dense` on.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from labkit.engine.compute.models.dsa import (
    dsa_select, indexer_k, indexer_q, indexer_scores, indexer_weights)
from labkit.engine.compute.models.family import family_config
from labkit.engine.compute.models.gqa import (
    gqa_output, gqa_qkv, gqa_scale, gqa_sinks, layer_window)
from labkit.engine.compute.models.kda import kda_attention
from labkit.engine.compute.models.layers import attention, causal_mask, linear, rms_norm
from labkit.engine.compute.models.mla import (
    mla_attention_naive, mla_latent, mla_output, mla_q)
from labkit.engine.compute.models.moe import dense_mlp, moe_mlp
from labkit.engine.compute.models.weights import layer_weights
from labkit.specs.models import ModelSpec

Tensor = torch.Tensor


def attention_block(spec: ModelSpec, w: Mapping[str, Tensor], layer: int, x: Tensor,
                    positions: Tensor) -> Tensor:
    """The attention sub-block of layer `layer` (structure) on normed input x `[T, H]`."""
    cfg = family_config(spec)
    eps = cfg.rms_norm_eps
    if spec.is_linear_layer(layer):
        return kda_attention(x, w, spec.linear_head_dim, eps=eps)[0]
    mask = causal_mask(positions, positions, layer_window(spec, layer))
    if spec.is_mla:
        q_nope, q_pe, qr = mla_q(x, w, spec, positions)
        latent = mla_latent(x, w, spec, positions)
        if spec.has_indexer:
            scores = indexer_scores(indexer_q(qr, w, spec, positions),
                                    indexer_k(x, w, spec, positions),
                                    indexer_weights(x, w, spec))
            mask = dsa_select(scores, mask, spec.index_topk, positions)
        out, _ = mla_attention_naive(q_nope, q_pe, latent, w["self_attn.kv_b_proj.weight"],
                                     spec, mask)
        return mla_output(out, w)
    q, k, v = gqa_qkv(x, w, spec.head_dim, positions, cfg.rope, eps)
    out, lse = attention(q, k, v, gqa_scale(spec.head_dim), mask)
    return gqa_output(gqa_sinks(out, lse, w), w)


def mlp_block(spec: ModelSpec, w: Mapping[str, Tensor], layer: int, x: Tensor) -> Tensor:
    return moe_mlp(x, w, spec) if spec.is_moe_layer(layer) else dense_mlp(x, w, spec)


def decoder_layer(spec: ModelSpec, w: Mapping[str, Tensor], layer: int, x: Tensor,
                  positions: Tensor) -> Tensor:
    """One pre-norm decoder layer; `layer` picks its structure, `w` its weights."""
    eps = family_config(spec).rms_norm_eps
    x = x + attention_block(spec, w, layer, rms_norm(x, w["input_layernorm.weight"], eps),
                            positions)
    return x + mlp_block(spec, w, layer, rms_norm(x, w["post_attention_layernorm.weight"], eps))


def _cast(weights: Mapping[str, Tensor], dtype: torch.dtype | None) -> Mapping[str, Tensor]:
    return weights if dtype is None else {k: v.to(dtype) for k, v in weights.items()}


def lm_head_weight(weights: Mapping[str, Tensor]) -> Tensor:
    if "lm_head.weight" in weights:  # (untied; a rank of the last stage may lack the
        return weights["lm_head.weight"]  # embedding)
    return weights["model.embed_tokens.weight"]


def reference_hidden(spec: ModelSpec, weights: Mapping[str, Tensor], token_ids: Tensor,
                     dtype: torch.dtype | None = None) -> Tensor:
    """Final hidden states `[T, H]` after the final norm (the LM head's input)."""
    weights = _cast(weights, dtype)
    token_ids = torch.as_tensor(token_ids, dtype=torch.long)
    x = weights["model.embed_tokens.weight"][token_ids]
    positions = torch.arange(token_ids.shape[0])
    for i in range(spec.num_layers):
        x = decoder_layer(spec, layer_weights(weights, i), i, x, positions)
    return rms_norm(x, weights["model.norm.weight"], family_config(spec).rms_norm_eps)


def reference_logits(spec: ModelSpec, weights: Mapping[str, Tensor], token_ids: Tensor,
                     dtype: torch.dtype | None = None) -> Tensor:
    """Logits `[T, vocab]` of a causal forward pass over `token_ids` `[T]`."""
    weights = _cast(weights, dtype)
    return linear(reference_hidden(spec, weights, token_ids), lm_head_weight(weights))


def reference_greedy(spec: ModelSpec, weights: Mapping[str, Tensor], prompt_ids: Tensor,
                     max_new_tokens: int, dtype: torch.dtype | None = None) -> list[int]:
    """Greedy continuation (argmax, lowest id on ties), recomputing the whole sequence
    each step — slow, simple, the ground truth for a runner's generated tokens."""
    weights = _cast(weights, dtype)
    seq = torch.as_tensor(prompt_ids, dtype=torch.long).tolist()
    out: list[int] = []
    for _ in range(max_new_tokens):
        out.append(int(reference_logits(spec, weights, torch.tensor(seq + out))[-1].argmax()))
    return out


def reference_mtp_logits(spec: ModelSpec, weights: Mapping[str, Tensor], token_ids: Tensor,
                         dtype: torch.dtype | None = None) -> list[Tensor]:
    """Logits of each DeepSeek MTP module; module j's row i drafts token i + j + 2.

    Module j at position i (i < T - 1 - j):
      `h = eh_proj([rms_norm_e(embed(t_{i+j+1})); rms_norm_h(prev_i)])`, one decoder
      layer (own weights, causal over the module's positions, same positions 0..),
      `logits = lm_head(shared_head.norm(h))` with the main model's LM head. prev is
      the main model's final *normed* hidden state for j = 0 (vLLM's convention) and
      module j-1's output (before shared_head.norm) after that. Returns one tensor
      `[T - 1 - j, vocab]` per module.
    """
    weights = _cast(weights, dtype)
    token_ids = torch.as_tensor(token_ids, dtype=torch.long)
    eps, L = family_config(spec).rms_norm_eps, spec.num_layers
    prev = reference_hidden(spec, weights, token_ids)
    emb = weights["model.embed_tokens.weight"]
    out = []
    for j in range(spec.num_mtp_modules):
        w = layer_weights(weights, L + j)
        n = token_ids.shape[0] - 1 - j
        e = rms_norm(emb[token_ids[j + 1: j + 1 + n]], w["enorm.weight"], eps)
        h = linear(torch.cat([e, rms_norm(prev[:n], w["hnorm.weight"], eps)], -1),
                   w["eh_proj.weight"])
        prev = decoder_layer(spec, w, L - 1, h, torch.arange(n))
        out.append(linear(rms_norm(prev, w["shared_head.norm.weight"], eps),
                          lm_head_weight(weights)))
    return out
