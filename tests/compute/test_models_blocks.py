"""Building blocks: MLA absorbed vs naive, KDA chunked vs stepped, routing, DSA, RoPE,
LSE merging and tensor-parallel slices."""

import pytest
import torch

from labkit.engine.compute.models import (
    attention_block, family_config, init_weights, layer_weights, mlp_block, tp_shard)
from labkit.engine.compute.models.dsa import (
    dsa_select, indexer_k, indexer_q, indexer_scores, indexer_weights)
from labkit.engine.compute.models.kda import (
    kda_attention, kda_chunked, kda_recurrent, kda_step, short_conv)
from labkit.engine.compute.models.layers import attention, causal_mask, rms_norm, rope
from labkit.engine.compute.models.mla import (
    mla_absorb_q, mla_attention_absorbed, mla_attention_naive, mla_latent, mla_q,
    mla_unabsorb_out)
from labkit.engine.compute.models.moe import route
from labkit.specs.model_presets import MODEL_PRESETS, get_model

F64 = torch.float64




def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _x(T, H, seed=0):
    return torch.randn(T, H, generator=_gen(seed), dtype=F64)


# ------------------------------------------------------------------------- MLA
@pytest.mark.parametrize("name", ["tiny-deepseek-v3", "tiny-kimi-linear"])
def test_mla_absorbed_decode_equals_naive(name):
    spec = get_model(name)
    w = layer_weights(init_weights(spec, dtype=F64), spec.num_layers - 1)
    T = 23
    x, pos = _x(T, spec.hidden_size), torch.arange(T)
    q_nope, q_pe, _ = mla_q(x, w, spec, pos)
    latent = mla_latent(x, w, spec, pos)
    assert latent.shape == (T, spec.kv_lora_rank + spec.qk_rope_head_dim)
    kv_b = w["self_attn.kv_b_proj.weight"]
    # the last token, decoding against the whole cache
    naive, lse_n = mla_attention_naive(q_nope[-1:], q_pe[-1:], latent, kv_b, spec)
    o_lat, lse_a = mla_attention_absorbed(mla_absorb_q(q_nope[-1:], kv_b, spec), q_pe[-1:],
                                          latent, spec)
    torch.testing.assert_close(mla_unabsorb_out(o_lat, kv_b, spec), naive, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse_a, lse_n, rtol=1e-12, atol=1e-12)
    # and every token under the causal mask
    mask = causal_mask(pos, pos)
    naive, _ = mla_attention_naive(q_nope, q_pe, latent, kv_b, spec, mask)
    o_lat, _ = mla_attention_absorbed(mla_absorb_q(q_nope, kv_b, spec), q_pe, latent, spec, mask)
    torch.testing.assert_close(mla_unabsorb_out(o_lat, kv_b, spec), naive, rtol=1e-12, atol=1e-12)


def test_attention_partials_merge_exactly_by_lse():
    T, S, H, D = 5, 17, 4, 8
    q = torch.randn(T, H, D, generator=_gen(1), dtype=F64)
    k = torch.randn(S, 2, D, generator=_gen(2), dtype=F64)
    v = torch.randn(S, 2, D, generator=_gen(3), dtype=F64)
    full, lse = attention(q, k, v, 0.3)
    shards = [torch.arange(S)[torch.arange(S) % 3 == r] for r in range(3)] + [torch.arange(0)]
    parts = [attention(q, k[i], v[i], 0.3) for i in shards]  # the last shard is empty
    assert torch.isneginf(parts[-1][1]).all() and (parts[-1][0] == 0).all()
    lses = torch.stack([p[1] for p in parts])
    merged_lse = torch.logsumexp(lses, 0)
    merged = sum(torch.exp(p[1] - merged_lse)[..., None] * p[0] for p in parts)
    torch.testing.assert_close(merged, full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(merged_lse, lse, rtol=1e-12, atol=1e-12)


def test_rope_is_relative_and_none_is_nope():
    q = torch.randn(1, 2, 16, generator=_gen(4), dtype=F64)
    k = torch.randn(1, 2, 16, generator=_gen(5), dtype=F64)

    def dot(m, n):
        return (rope(q, torch.tensor([m]), 1e4) * rope(k, torch.tensor([n]), 1e4)).sum()

    torch.testing.assert_close(dot(7, 3), dot(1004, 1000))
    assert not torch.allclose(dot(7, 3), dot(7, 5))
    assert rope(q, torch.tensor([9]), None) is q
    torch.testing.assert_close(rope(q, torch.tensor([0]), 1e4), q)


# ------------------------------------------------------------------------- KDA
def _kda_inputs(T, h=3, dk=8, dv=6, seed=0):
    g = _gen(seed)
    q = torch.nn.functional.normalize(torch.randn(T, h, dk, generator=g, dtype=F64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(T, h, dk, generator=g, dtype=F64), dim=-1)
    v = torch.randn(T, h, dv, generator=g, dtype=F64)
    decay = -torch.rand(T, h, dk, generator=g, dtype=F64) * 0.5
    beta = torch.rand(T, h, generator=g, dtype=F64)
    return q, k, v, decay, beta


@pytest.mark.parametrize("chunk", [1, 4, 7, 64])
def test_kda_chunked_equals_stepping(chunk):
    q, k, v, g, beta = _kda_inputs(29)
    s0 = torch.randn(3, 8, 6, generator=_gen(9), dtype=F64)
    o_r, s_r = kda_recurrent(q, k, v, g, beta, s0)
    o_c, s_c = kda_chunked(q, k, v, g, beta, s0, chunk_size=chunk)
    torch.testing.assert_close(o_c, o_r, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s_c, s_r, rtol=1e-10, atol=1e-10)
    # kda_step is the recurrence itself, batchable over leading dims
    o1, s1 = kda_step(s0[None].expand(2, -1, -1, -1), q[:2], k[:2], v[:2], g[:2], beta[:2])
    torch.testing.assert_close(o1[0], kda_step(s0, q[0], k[0], v[0], g[0], beta[0])[0])


def test_kda_delta_rule_overwrites_a_key():
    # With no decay and beta = 1, writing (k, v) then (k, v') leaves S^T k = v'.
    k = torch.nn.functional.normalize(torch.randn(1, 4, dtype=F64), dim=-1)
    s = torch.zeros(1, 4, 3, dtype=F64)
    zero, one = torch.zeros(1, 4, dtype=F64), torch.ones(1, dtype=F64)
    _, s = kda_step(s, k, k, torch.ones(1, 3, dtype=F64), zero, one)
    out, s = kda_step(s, k, k, torch.full((1, 3), 5.0, dtype=F64), zero, one)
    torch.testing.assert_close(out, torch.full((1, 3), 5.0, dtype=F64))


def test_kda_layer_continues_from_its_state():
    spec = get_model("tiny-kimi-linear")
    w = layer_weights(init_weights(spec, dtype=F64), 1)
    x = _x(21, spec.hidden_size, seed=2)
    d = spec.linear_head_dim
    whole, s_whole = kda_attention(x, w, d)
    a, s = kda_attention(x[:13], w, d)  # a prefill chunk ...
    b, s = kda_attention(x[13:18], w, d, s)  # ... another ...
    steps = []
    for t in range(18, 21):  # ... then decode, one token at a time, stepping
        o, s = kda_attention(x[t:t + 1], w, d, s, chunk_size=None)
        steps.append(o)
    torch.testing.assert_close(torch.cat([a, b, *steps]), whole, rtol=1e-10, atol=1e-10)
    for got, want in zip(s, s_whole):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_short_conv_streams():
    x = _x(9, 5, seed=3)
    weight = torch.randn(5, 1, 4, generator=_gen(6), dtype=F64)
    y, _ = short_conv(x, weight, None)
    y1, st = short_conv(x[:2], weight, None)
    y2, _ = short_conv(x[2:], weight, st)
    torch.testing.assert_close(torch.cat([y1, y2]), y)
    want = torch.nn.functional.conv1d(x.T[None], weight, padding=3, groups=5)[0, :, :9].T
    torch.testing.assert_close(y, torch.nn.functional.silu(want))


# ------------------------------------------------------------------------- MoE
@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-kimi-linear"])
def test_routing_properties(name):
    spec = get_model(name)
    cfg = family_config(spec)
    x = _x(50, spec.hidden_size, seed=7).float()
    router = torch.randn(spec.num_experts, spec.hidden_size, generator=_gen(8)) / 8
    ids, weights = route(x, {"mlp.gate.weight": router}, spec)
    k = spec.num_experts_per_tok
    assert ids.shape == weights.shape == (50, k) and ids.dtype == torch.int64
    assert all(len(set(r)) == k for r in ids.tolist())
    torch.testing.assert_close(weights.sum(-1), torch.full((50,), cfg.routed_scaling_factor))
    assert (weights[:, :-1] >= weights[:, 1:]).all()  # picks come best first
    assert cfg.router_scoring == ("softmax" if spec.family == "qwen3_moe" else "sigmoid")
    # ties go to the lower expert id, and routing is a pure function of its inputs
    ids0, _ = route(torch.zeros(3, spec.hidden_size), {"mlp.gate.weight": router}, spec)
    assert ids0.tolist() == [list(range(k))] * 3
    assert torch.equal(route(x, {"mlp.gate.weight": router}, spec)[0], ids)


def test_router_bias_steers_choice_not_weights():
    spec = get_model("tiny-deepseek-v3")
    x = _x(6, spec.hidden_size, seed=9).float()
    router = torch.randn(spec.num_experts, spec.hidden_size, generator=_gen(10)) / 8
    bias = torch.zeros(spec.num_experts)
    bias[5] = 10.0
    ids, w = route(x, {"mlp.gate.weight": router, "mlp.gate.e_score_correction_bias": bias},
                   spec)
    assert (ids[:, 0] == 5).all()
    s = torch.sigmoid(x @ router.T).gather(1, ids)
    torch.testing.assert_close(w, s / s.sum(-1, keepdim=True) * 2.5)


# ------------------------------------------------------------------------- DSA
def _dsa_parts(spec, T):
    w = layer_weights(init_weights(spec, dtype=F64), 1)
    x, pos = _x(T, spec.hidden_size, seed=11), torch.arange(T)
    _, _, qr = mla_q(x, w, spec, pos)
    scores = indexer_scores(indexer_q(qr, w, spec, pos), indexer_k(x, w, spec, pos),
                            indexer_weights(x, w, spec))
    return w, x, pos, scores


def test_dsa_with_topk_covering_the_sequence_is_full_mla():
    spec = get_model("tiny-deepseek-v3.2")
    T = spec.index_topk
    w, x, pos, scores = _dsa_parts(spec, T)
    causal = causal_mask(pos, pos)
    assert torch.equal(dsa_select(scores, causal, spec.index_topk, pos), causal)
    dense = get_model("tiny-deepseek-v3")  # same weights, no indexer
    w_dense = {n: t for n, t in w.items() if ".indexer." not in n}
    torch.testing.assert_close(attention_block(spec, w, 1, x, pos),
                               attention_block(dense, w_dense, 1, x, pos), rtol=0, atol=0)


def test_dsa_selects_the_top_scoring_causal_positions():
    spec = get_model("tiny-deepseek-v3.2")
    T, topk = 50, 8
    _, _, pos, scores = _dsa_parts(spec, T)
    causal = causal_mask(pos, pos)
    sel = dsa_select(scores, causal, topk, pos)
    assert not (sel & ~causal).any()
    assert sel.sum(-1).tolist() == [min(t + 1, topk) for t in range(T)]
    for t in range(topk, T):
        chosen, rest = scores[t][sel[t]], scores[t][causal[t] & ~sel[t]]
        assert chosen.min() >= rest.max()
    # ties (ReLU zeros are common) go to the earlier position, whatever the column order
    flat = torch.zeros(1, 6)
    assert dsa_select(flat, torch.ones(1, 6, dtype=torch.bool), 2).tolist() == \
        [[True, True, False, False, False, False]]
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    sel_p = dsa_select(flat, torch.ones(1, 6, dtype=torch.bool), 2, perm)
    assert perm[sel_p[0]].sort().values.tolist() == [0, 1]


# --------------------------------------------------------------- TP slices
@pytest.mark.parametrize("name", [n for n in MODEL_PRESETS if n.startswith("tiny-")])
@pytest.mark.parametrize("size", [2, 4])
def test_tp_slices_sum_to_the_full_blocks(name, size):
    spec = get_model(name)
    full = init_weights(spec, dtype=F64)
    shards = [tp_shard(spec, full, r, size) for r in range(size)]
    T = 11
    x, pos = rms_norm(_x(T, spec.hidden_size, seed=12), torch.ones(spec.hidden_size, dtype=F64)), \
        torch.arange(T)
    for i in range(spec.num_layers):
        wf = layer_weights(full, i)
        ws = [layer_weights(s, i) for s in shards]
        for block in (lambda w, i=i: attention_block(spec, w, i, x, pos),
                      lambda w, i=i: mlp_block(spec, w, i, x)):
            torch.testing.assert_close(sum(block(w) for w in ws), block(wf),
                                       rtol=1e-10, atol=1e-10)
