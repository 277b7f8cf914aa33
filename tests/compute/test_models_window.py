"""The reference model's sliding-window layers (tiny-gpt-oss: layer 0, W = 24)."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from labkit.engine.compute.models import (
    attention_block, decoder_layer, family_config, init_weights, layer_weights, reference_logits)
from labkit.engine.compute.models.gqa import gqa_output, gqa_qkv
from labkit.engine.compute.models.layers import causal_mask
from labkit.specs import get_model

F64 = torch.float64
SPEC = get_model("tiny-gpt-oss")
W = SPEC.sliding_window


def _ids(T, seed=0):
    return torch.randint(0, SPEC.vocab_size, (T,), generator=torch.Generator().manual_seed(seed))


def test_windowed_causal_mask_by_enumeration():
    pos = torch.arange(9)
    got = causal_mask(pos, pos, 3)
    want = [[q - 3 < k <= q for k in range(9)] for q in range(9)]
    assert got.tolist() == want
    assert torch.equal(causal_mask(pos, pos, 0), causal_mask(pos, pos))


def test_sliding_layer_equals_naive_attention_over_the_last_w_positions():
    """Layer 0's attention block against a per-query loop that slices keys p-W+1..p."""
    w = layer_weights(init_weights(SPEC, dtype=F64), 0)
    T = 2 * W + 5
    x = torch.randn(T, SPEC.hidden_size, dtype=F64, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(T)
    cfg = family_config(SPEC)
    q, k, v = gqa_qkv(x, w, SPEC.head_dim, pos, cfg.rope, cfg.rms_norm_eps)
    group = SPEC.num_heads // SPEC.num_kv_heads
    out = torch.zeros_like(q)
    for p in range(T):
        lo = max(0, p - W + 1)
        for h in range(SPEC.num_heads):
            scores = k[lo:p + 1, h // group] @ q[p, h] / math.sqrt(SPEC.head_dim)
            # gpt-oss's sink: one more logit in the softmax, with no value behind it
            probs = torch.softmax(torch.cat([scores, w["self_attn.sinks"][h:h + 1]]), 0)
            out[p, h] = probs[:-1] @ v[lo:p + 1, h // group]
    torch.testing.assert_close(attention_block(SPEC, w, 0, x, pos), gqa_output(out, w),
                               rtol=1e-10, atol=1e-10)


def test_a_window_longer_than_the_sequence_is_full_attention():
    full = replace(SPEC, name="no-window", sliding_window=0, sliding_window_layers=())
    w = init_weights(SPEC, dtype=F64)
    ids = _ids(3 * W)
    swa, dense = reference_logits(SPEC, w, ids), reference_logits(full, w, ids)
    # up to W tokens the window holds everything; past it, the sliding layer forgets
    torch.testing.assert_close(swa[:W], dense[:W], rtol=1e-10, atol=1e-10)
    assert (swa[W:] - dense[W:]).abs().amax(-1).min() > 1e-6
    wide = replace(SPEC, name="wide-window", sliding_window=3 * W)
    torch.testing.assert_close(reference_logits(wide, w, ids), dense, rtol=1e-10, atol=1e-10)


def test_a_sliding_decoder_layer_forgets_what_left_the_window():
    """Layer 0 as a whole (attention + MoE, both per position but the attention): the
    output at p does not depend on inputs W or more positions back, while positions
    stay absolute (RoPE)."""
    w = layer_weights(init_weights(SPEC, dtype=F64), 0)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2 * W, SPEC.hidden_size, dtype=F64, generator=g)
    changed = x.clone()
    changed[:5] = torch.randn(5, SPEC.hidden_size, dtype=F64, generator=g)
    pos = torch.arange(2 * W)
    a, b = decoder_layer(SPEC, w, 0, x, pos), decoder_layer(SPEC, w, 0, changed, pos)
    # position p sees p-W+1..p: from p = W + 4 on, nothing that changed
    torch.testing.assert_close(a[W + 4:], b[W + 4:], rtol=1e-10, atol=1e-10)
    assert (a[W + 3] - b[W + 3]).abs().max() > 1e-6  # still sees position 4
    full = decoder_layer(SPEC, w, 1, x, pos) - decoder_layer(SPEC, w, 1, changed, pos)
    assert full[-1].abs().max() > 1e-6  # (layer 1's own weights, full attention: remembers)
