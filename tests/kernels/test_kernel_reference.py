"""The torch references (what runs on CPU) against independent naive float64 math."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import (
    assert_close, assert_lse, gqa_case, naive_attention, naive_gather, pack_sequences, rand,
)

import labkit.kernels as K

pytestmark = pytest.mark.usefixtures("torch_backend")


def _decode_expected(q, ks, vs, scale):
    outs, lses = [], []
    for b in range(q.shape[0]):
        o, ls = naive_attention(q[b:b + 1], ks[b], vs[b], scale)
        outs.append(o[0])
        lses.append(ls[0])
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Hq,Hkv,D", [(4, 4, 64), (8, 2, 128), (16, 2, 64)])
def test_paged_decode_matches_naive(g, dtype, Hq, Hkv, D):
    # ragged, one empty (DCP shard), request 3 shares request 0's first two blocks
    lens = [37, 0, 100, 45]
    q, kc, vc, table, sl, ks, vs = gqa_case(g, lens, Hq, Hkv, D, 16, dtype, share=(3, 0, 2))
    assert table[3, 0] == table[0, 0] and table[3, 1] == table[0, 1]
    scale = D ** -0.5
    out, lse = K.paged_decode_attention(q, kc, vc, table, sl, scale)
    assert K.last_backend["paged_decode_attention"] == "torch"
    assert out.dtype == dtype and lse.dtype == torch.float32
    eo, el = _decode_expected(q, ks, vs, scale)
    assert_close(out, eo, dtype, "out")
    assert_lse(lse, el)
    assert torch.all(out[1] == 0) and torch.all(lse[1] == float("-inf"))


def test_paged_decode_gathers_through_the_table(g):
    """Independent gather: positions read one by one through the block table."""
    lens = [50, 7]
    q, kc, vc, table, sl, ks, vs = gqa_case(g, lens, 4, 1, 64, 8, torch.float32)
    for b, L in enumerate(lens):
        torch.testing.assert_close(naive_gather(kc, table[b], L), ks[b].double())
    out, lse = K.paged_decode_attention(q, kc, vc, table, sl, 0.1)
    eo, el = _decode_expected(q, ks, vs, 0.1)
    assert_close(out, eo, torch.float32)
    assert_lse(lse, el)


def test_packed_cache_views(g):
    """K and V interleaved in one packed buffer [NB, 2, BS, H, D]: strided views work."""
    lens = [20, 33]
    q, kc, vc, table, sl, ks, vs = gqa_case(g, lens, 8, 2, 64, 16, torch.float32)
    packed = torch.stack([kc, vc], dim=1)
    k_view, v_view = packed[:, 0], packed[:, 1]
    assert not k_view.is_contiguous()
    out, lse = K.paged_decode_attention(q, k_view, v_view, table, sl, 0.125)
    eo, el = _decode_expected(q, ks, vs, 0.125)
    assert_close(out, eo, torch.float32)
    assert_lse(lse, el)


def _mla_case(g, lens, H, Dl, Dr, BS, dtype, Q=1):
    lat = [rand(g, L, Dl + Dr, dtype=dtype) for L in lens]
    (cache,), table, sl = pack_sequences(lat, BS, g)
    q = rand(g, len(lens), Q, H, Dl + Dr, dtype=dtype)
    return q, cache, table, sl, lat


def _mla_expected(q, lat, Dl, scale, lens):
    B, Q, H, _ = q.shape
    outs = torch.zeros(B, Q, H, Dl, dtype=torch.float64)
    lses = torch.full((B, Q, H), float("-inf"), dtype=torch.float64)
    for b, L in enumerate(lens):
        k = lat[b][:, None, :]
        visible = torch.tensor([[t <= L - Q + j for t in range(L)] for j in range(Q)],
                               dtype=torch.bool).reshape(Q, L)
        o, ls = naive_attention(q[b], k, k[..., :Dl], scale, visible)
        outs[b], lses[b] = o, ls
    return outs, lses


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Q", [1, 3])
def test_mla_decode_matches_naive(g, dtype, Q):
    lens, H, Dl, Dr = [40, 0, 70, 2], 4, 32, 16
    q, cache, table, sl, lat = _mla_case(g, lens, H, Dl, Dr, 16, dtype, Q)
    scale = (Dl + Dr) ** -0.5
    if Q == 1:
        out, lse = K.mla_paged_decode(q[:, 0], cache, table, sl, scale, kv_lora_rank=Dl)
        assert out.shape == (4, H, Dl) and lse.shape == (4, H)
        out, lse = out[:, None], lse[:, None]
    else:
        out, lse = K.mla_paged_decode(q, cache, table, sl, scale, kv_lora_rank=Dl)
    eo, el = _mla_expected(q, lat, Dl, scale, lens)
    assert_close(out, eo, dtype, "out")
    assert_lse(lse, el)
    # request 3 has 2 tokens and 3 queries: the first query sees nothing
    if Q == 3:
        assert torch.all(lse[3, 0] == float("-inf")) and torch.all(out[3, 0] == 0)


def _dcp_shards(seq, n, interleave):
    """Token i goes to rank (i // interleave) % n."""
    idx = [[i for i in range(seq.shape[0]) if (i // interleave) % n == r] for r in range(n)]
    return [seq[i] for i in idx]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_equals_attention_over_concatenated_shards(g, dtype):
    """DCP: each rank attends its local tokens; merging the partials is exact attention
    over the whole sequence. Request 1 is short, so some ranks hold none of its tokens."""
    N, interleave, Hq, Hkv, D, BS = 4, 8, 8, 2, 64, 16
    lens = [90, 12, 0]
    ks = [rand(g, L, Hkv, D, dtype=dtype) for L in lens]
    vs = [rand(g, L, Hkv, D, dtype=dtype) for L in lens]
    q = rand(g, len(lens), Hq, D, dtype=dtype)
    outs, lses = [], []
    for r in range(N):
        local = [(_dcp_shards(k, N, interleave)[r], _dcp_shards(v, N, interleave)[r])
                 for k, v in zip(ks, vs)]
        (kc, vc), table, sl = pack_sequences(local, BS, g)
        o, ls = K.paged_decode_attention(q, kc, vc, table, sl, D ** -0.5)
        outs.append(o)
        lses.append(ls)
    assert torch.all(torch.stack(lses)[2:, 1] == float("-inf"))  # ranks 2, 3: empty
    out, lse = K.merge_attn_states(torch.stack(outs), torch.stack(lses))
    eo, el = _decode_expected(q, ks, vs, D ** -0.5)
    assert_close(out, eo, dtype, "merged out")
    assert_lse(lse, el)
    assert torch.all(out[2] == 0) and torch.all(lse[2] == float("-inf"))
    assert not torch.isnan(out.float()).any()


def test_merge_ignores_garbage_in_empty_shards(g):
    outs = rand(g, 3, 2, 4, 16)
    lses = rand(g, 3, 2, 4)
    lses[1] = float("-inf")
    outs[1] = float("nan")
    out, lse = K.merge_attn_states(outs, lses)
    out2, lse2 = K.merge_attn_states(outs[[0, 2]], lses[[0, 2]])
    torch.testing.assert_close(out, out2)
    torch.testing.assert_close(lse, lse2)
    # a single partial merges to itself; a list of partials is accepted
    o1, l1 = K.merge_attn_states([outs[0]], [lses[0]])
    torch.testing.assert_close(o1, outs[0])
    torch.testing.assert_close(l1, lses[0])


def test_merge_all_empty_gives_zero_and_minus_inf():
    outs = torch.full((3, 2, 4, 8), float("nan"))
    lses = torch.full((3, 2, 4), float("-inf"))
    out, lse = K.merge_attn_states(outs, lses)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))


def _prefill_case(g, prefix, new, Hq, Hkv, D, BS, dtype):
    """Per request: a cached prefix (paged) and `new` fresh tokens."""
    kp = [rand(g, P, Hkv, D, dtype=dtype) for P in prefix]
    vp = [rand(g, P, Hkv, D, dtype=dtype) for P in prefix]
    (kc, vc), table, pl = pack_sequences(list(zip(kp, vp)), BS, g)
    T = sum(new)
    q = rand(g, T, Hq, D, dtype=dtype)
    kn = rand(g, T, Hkv, D, dtype=dtype)
    vn = rand(g, T, Hkv, D, dtype=dtype)
    qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    return q, kn, vn, kc, vc, table, pl, qsl, kp, vp


def _prefill_expected(q, kn, vn, kp, vp, qsl, scale):
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
    for b in range(len(kp)):
        s, e = int(qsl[b]), int(qsl[b + 1])
        P, n = kp[b].shape[0], e - s
        k = torch.cat([kp[b], kn[s:e]])
        v = torch.cat([vp[b], vn[s:e]])
        visible = torch.tensor([[j < P or j - P <= i for j in range(P + n)] for i in range(n)],
                               dtype=torch.bool).reshape(n, P + n)
        out[s:e], lse[s:e] = naive_attention(q[s:e], k, v, scale, visible)
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (8, 2)])
def test_prefill_matches_naive(g, dtype, Hq, Hkv):
    prefix, new = [33, 0, 16, 5], [7, 12, 0, 1]
    D = 64
    q, kn, vn, kc, vc, table, pl, qsl, kp, vp = _prefill_case(g, prefix, new, Hq, Hkv, D, 16,
                                                             dtype)
    out, lse = K.paged_prefill_attention(q, kn, vn, kc, vc, table, pl, qsl, D ** -0.5)
    eo, el = _prefill_expected(q, kn, vn, kp, vp, qsl, D ** -0.5)
    assert_close(out, eo, dtype, "out")
    assert_lse(lse, el)


def test_prefill_then_decode_consistency(g):
    """Chunked prefill of the last token over the cached prefix == decode of that token."""
    D, BS = 64, 8
    q, kc, vc, table, sl, ks, vs = gqa_case(g, [30, 9], 8, 2, D, BS, torch.float32)
    # the last token's K/V are "new"; the prefix is everything before it
    pl = sl - 1
    kn = torch.stack([ks[0][-1], ks[1][-1]])
    vn = torch.stack([vs[0][-1], vs[1][-1]])
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    out_p, lse_p = K.paged_prefill_attention(q, kn, vn, kc, vc, table, pl, qsl, D ** -0.5)
    out_d, lse_d = K.paged_decode_attention(q, kc, vc, table, sl, D ** -0.5)
    torch.testing.assert_close(out_p, out_d, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_p, lse_d, atol=1e-5, rtol=1e-5)


def _sparse_case(g, lens, H, Dl, Dr, BS, dtype, topk, tokens_per_req):
    lat = [rand(g, L, Dl + Dr, dtype=dtype) for L in lens]
    (cache,), table, _ = pack_sequences(lat, BS, g)
    req = [b for b, n in enumerate(tokens_per_req) for _ in range(n)]
    T = len(req)
    idx = torch.full((T, topk), -1, dtype=torch.int32)
    for t, b in enumerate(req):
        k = min(lens[b], topk - 1 if t % 2 else topk)  # some rows padded
        idx[t, :k] = torch.randperm(lens[b], generator=g)[:k].to(torch.int32)
    q = rand(g, T, H, Dl + Dr, dtype=dtype)
    return q, cache, idx, table, torch.tensor(req, dtype=torch.int32), lat


def _sparse_expected(q, idx, req, lat, Dl, scale):
    T, H, _ = q.shape
    out = torch.zeros(T, H, Dl, dtype=torch.float64)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float64)
    for t in range(T):
        sel = [int(p) for p in idx[t] if p >= 0]
        k = lat[int(req[t])][sel][:, None, :] if sel else lat[0][:0, None, :]
        out[t], lse[t] = naive_attention(q[t:t + 1], k, k[..., :Dl], scale)
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_topk_matches_naive(g, dtype):
    lens, H, Dl, Dr = [60, 25, 0], 4, 32, 16
    q, cache, idx, table, req, lat = _sparse_case(g, lens, H, Dl, Dr, 16, dtype, 20, [3, 2, 1])
    assert torch.all(idx[-1] == -1)  # request 2 is empty: its token selects nothing
    scale = (Dl + Dr) ** -0.5
    out, lse = K.sparse_topk_attention(q, cache, idx, table, req, scale, kv_lora_rank=Dl)
    eo, el = _sparse_expected(q, idx, req, lat, Dl, scale)
    assert_close(out, eo, dtype, "out")
    assert_lse(lse, el)
    assert torch.all(lse[-1] == float("-inf")) and torch.all(out[-1] == 0)


def test_sparse_selecting_everything_is_dense_mla(g):
    lens, H, Dl, Dr = [40, 17], 4, 32, 16
    q, cache, table, sl, _ = _mla_case(g, lens, H, Dl, Dr, 16, torch.float32)
    dense, dense_lse = K.mla_paged_decode(q[:, 0], cache, table, sl, 0.2, kv_lora_rank=Dl)
    idx = torch.full((2, 48), -1, dtype=torch.int32)
    for b, L in enumerate(lens):
        idx[b, :L] = torch.randperm(L, generator=g).to(torch.int32)
    out, lse = K.sparse_topk_attention(q[:, 0], cache, idx, table,
                                       torch.tensor([0, 1], dtype=torch.int32), 0.2,
                                       kv_lora_rank=Dl)
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, dense_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_round_trip(g, dtype):
    NB, BS, H, D, T = 6, 4, 2, 16, 9
    kc, vc = rand(g, NB, BS, H, D, dtype=dtype), rand(g, NB, BS, H, D, dtype=dtype)
    k0, v0 = kc.clone(), vc.clone()
    k, v = rand(g, T, H, D, dtype=dtype), rand(g, T, H, D, dtype=dtype)
    slots = torch.randperm(NB * BS, generator=g)[:T]
    slots[[2, 5]] = -1  # tokens this rank does not own
    K.reshape_and_cache(k, v, kc, vc, slots)
    for t in range(T):
        s = int(slots[t])
        if s >= 0:
            assert torch.equal(kc[s // BS, s % BS], k[t]) and torch.equal(vc[s // BS, s % BS], v[t])
    written = torch.zeros(NB * BS, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    untouched = ~written.view(NB, BS)
    assert torch.equal(kc[untouched], k0[untouched]) and torch.equal(vc[untouched], v0[untouched])

    lat_cache = rand(g, NB, BS, 24, dtype=dtype)
    l0 = lat_cache.clone()
    lat = rand(g, T, 24, dtype=dtype)
    K.reshape_and_cache_latent(lat, lat_cache, slots.to(torch.int32))
    for t in range(T):
        s = int(slots[t])
        if s >= 0:
            assert torch.equal(lat_cache[s // BS, s % BS], lat[t])
    assert torch.equal(lat_cache[untouched], l0[untouched])


def test_cache_then_decode(g):
    """Writing K/V with reshape_and_cache then decoding == decoding the sequences."""
    NB, BS, Hkv, D = 8, 4, 2, 32
    kc, vc = torch.zeros(NB, BS, Hkv, D), torch.zeros(NB, BS, Hkv, D)
    k, v = rand(g, 11, Hkv, D), rand(g, 11, Hkv, D)
    blocks = [5, 1, 7]
    slots = torch.tensor([blocks[t // BS] * BS + t % BS for t in range(11)])
    K.reshape_and_cache(k, v, kc, vc, slots)
    table = torch.tensor([blocks + [-3]], dtype=torch.int32)
    q = rand(g, 1, 4, D)
    out, lse = K.paged_decode_attention(q, kc, vc, table, torch.tensor([11], dtype=torch.int32),
                                        0.3)
    eo, el = naive_attention(q, k, v, 0.3)
    assert_close(out, eo, torch.float32)
    assert_lse(lse, el)
