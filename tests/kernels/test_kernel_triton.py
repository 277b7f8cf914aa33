"""The Triton kernels against the torch references (interpreted on CPU, compiled on a GPU).

Small shapes: Triton's interpreter runs each program instance in Python/numpy.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import assert_close, assert_lse, gqa_case, pack_sequences, rand

import labkit.kernels as K
from labkit.kernels import dispatch, reference

pytestmark = pytest.mark.usefixtures("triton_backend")
# Triton vs reference, both from the same inputs (bf16 rounds P to bf16 before P@V, as
# FlashAttention does; the reference keeps P in fp32): assert_close's per-dtype bounds,
# and LSEs a little looser than against float64 math
LSE_ATOL = 2e-4


def _to(device, *xs):
    return [x.to(device) if isinstance(x, torch.Tensor) else x for x in xs]


def _ran_triton(name, before):
    assert K.last_backend[name] == "triton"
    assert dispatch.dispatch_counts[(name, "triton")] == before + 1
    # on CPU, the kernels that ran were built for the interpreter
    assert dispatch.triton_module(interpret=not torch.cuda.is_available()).interpreted() \
        == (not torch.cuda.is_available())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Hq,Hkv,D", [(4, 4, 64), (8, 2, 128), (16, 2, 64)])
def test_paged_decode(g, device, dtype, Hq, Hkv, D):
    lens = [37, 0, 100, 45]  # ragged, an empty DCP shard, request 3 shares 0's blocks
    q, kc, vc, table, sl, _, _ = gqa_case(g, lens, Hq, Hkv, D, 16, dtype, share=(3, 0, 2))
    ref = reference.paged_decode_attention(q, kc, vc, table, sl, D ** -0.5)
    q, kc, vc, table, sl = _to(device, q, kc, vc, table, sl)
    n = dispatch.dispatch_counts[("paged_decode_attention", "triton")]
    for splits in (None, 1, 3):  # default grid, one chunk (no merge), three chunks
        out, lse = K.paged_decode_attention(q, kc, vc, table, sl, D ** -0.5, num_splits=splits)
        _ran_triton("paged_decode_attention", n)
        n += 1
        assert out.dtype == dtype and lse.dtype == torch.float32 and out.device == q.device
        assert_close(out, ref[0], dtype, f"out, {splits} splits")
        assert_lse(lse, ref[1], atol=LSE_ATOL)
        assert torch.all(out[1] == 0) and torch.all(lse[1] == float("-inf"))


def test_paged_decode_packed_views_and_page_size(g, device):
    """K/V interleaved in one packed buffer (strided views), page size 5 (not a power of
    two), a float16 cache."""
    dtype = torch.float16
    q, kc, vc, table, sl, _, _ = gqa_case(g, [23, 11], 8, 1, 64, 5, dtype)
    ref = reference.paged_decode_attention(q, kc, vc, table, sl, 0.125)
    packed = torch.stack([kc, vc], dim=1).to(device)
    q, table, sl = _to(device, q, table, sl)
    out, lse = K.paged_decode_attention(q, packed[:, 0], packed[:, 1], table, sl, 0.125)
    assert_close(out, ref[0], dtype, "out")
    assert_lse(lse, ref[1], atol=LSE_ATOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Q", [1, 3])
def test_mla_decode(g, device, dtype, Q):
    lens, H, Dl, Dr = [40, 0, 70, 2], 4, 32, 16
    lat = [rand(g, L, Dl + Dr, dtype=dtype) for L in lens]
    (cache,), table, sl = pack_sequences(lat, 16, g)
    q = rand(g, len(lens), Q, H, Dl + Dr, dtype=dtype)
    scale = (Dl + Dr) ** -0.5
    ref = reference.mla_paged_decode(q, cache, table, sl, scale, Dl)
    q, cache, table, sl = _to(device, q, cache, table, sl)
    n = dispatch.dispatch_counts[("mla_paged_decode", "triton")]
    out, lse = K.mla_paged_decode(q, cache, table, sl, scale, kv_lora_rank=Dl, num_splits=2)
    _ran_triton("mla_paged_decode", n)
    assert_close(out, ref[0], dtype, "out")
    assert_lse(lse, ref[1], atol=LSE_ATOL)
    if Q == 1:
        out1, lse1 = K.mla_paged_decode(q[:, 0], cache, table, sl, scale, kv_lora_rank=Dl)
        assert_close(out1, ref[0][:, 0], dtype, "out (3-D q, default splits)")
        assert_lse(lse1, ref[1][:, 0], atol=LSE_ATOL)


def test_mla_decode_many_heads_no_rope(g, device):
    """More rows than one row block (Q*H = 40 > 32), a latent without rope dims."""
    lens, H, Dl = [30, 19], 20, 64
    lat = [rand(g, L, Dl, dtype=torch.bfloat16) for L in lens]
    (cache,), table, sl = pack_sequences(lat, 8, g)
    q = rand(g, 2, 2, H, Dl, dtype=torch.bfloat16)
    ref = reference.mla_paged_decode(q, cache, table, sl, 0.1, Dl)
    q, cache, table, sl = _to(device, q, cache, table, sl)
    out, lse = K.mla_paged_decode(q, cache, table, sl, 0.1, kv_lora_rank=Dl)
    assert_close(out, ref[0], torch.bfloat16, "out")
    assert_lse(lse, ref[1], atol=LSE_ATOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge(g, device, dtype):
    outs = rand(g, 5, 3, 4, 64, dtype=dtype)
    lses = rand(g, 5, 3, 4) * 3
    lses[1] = float("-inf")       # an empty shard everywhere ...
    outs[1] = float("nan")        # ... whose output is garbage
    lses[:, 2, 1] = float("-inf")  # all shards empty for one (b, h)
    ref = reference.merge_attn_states(outs, lses)
    n = dispatch.dispatch_counts[("merge_attn_states", "triton")]
    out, lse = K.merge_attn_states(*_to(device, outs, lses))
    _ran_triton("merge_attn_states", n)
    assert not torch.isnan(out.float()).any()
    assert_close(out, ref[0], dtype, "out")
    assert_lse(lse, ref[1], atol=LSE_ATOL)
    assert torch.all(out[2, 1] == 0) and lse[2, 1] == float("-inf")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache(g, device, dtype):
    NB, BS, H, D, T = 6, 4, 4, 64, 9
    kc, vc = rand(g, NB, BS, H, D, dtype=dtype), rand(g, NB, BS, H, D, dtype=dtype)
    k, v = rand(g, T, H, D, dtype=dtype), rand(g, T, H, D, dtype=dtype)
    slots = torch.randperm(NB * BS, generator=g)[:T]
    slots[[0, 4]] = -1
    ek, ev = kc.clone(), vc.clone()
    reference.reshape_and_cache(k, v, ek, ev, slots)
    # caches as strided views into one packed buffer
    packed = torch.stack([kc, vc], dim=1).to(device)
    n = dispatch.dispatch_counts[("reshape_and_cache", "triton")]
    K.reshape_and_cache(*_to(device, k, v), packed[:, 0], packed[:, 1], slots.to(device))
    _ran_triton("reshape_and_cache", n)
    assert torch.equal(packed[:, 0].cpu(), ek) and torch.equal(packed[:, 1].cpu(), ev)

    lat_cache = rand(g, NB, BS, 48, dtype=dtype)
    lat = rand(g, T, 48, dtype=dtype)
    expect = lat_cache.clone()
    reference.reshape_and_cache(lat, None, expect, None, slots)
    lat_cache = lat_cache.to(device)
    K.reshape_and_cache_latent(lat.to(device), lat_cache, slots.to(torch.int32).to(device))
    assert K.last_backend["reshape_and_cache_latent"] == "triton"
    assert torch.equal(lat_cache.cpu(), expect)


@pytest.mark.parametrize("dtype,Hq,Hkv,D", [(torch.float32, 4, 4, 64),
                                            (torch.bfloat16, 8, 2, 128)])
def test_prefill(g, device, dtype, Hq, Hkv, D):
    prefix, new = [33, 0, 16, 5], [7, 70, 0, 1]  # 70 new tokens: more than one query tile
    kp = [rand(g, P, Hkv, D, dtype=dtype) for P in prefix]
    vp = [rand(g, P, Hkv, D, dtype=dtype) for P in prefix]
    (kc, vc), table, pl = pack_sequences(list(zip(kp, vp)), 16, g)
    T = sum(new)
    q, kn, vn = (rand(g, T, h, D, dtype=dtype) for h in (Hq, Hkv, Hkv))
    qsl = torch.tensor([0, 7, 77, 77, 78], dtype=torch.int32)
    ref = reference.paged_prefill_attention(q, kn, vn, kc, vc, table, pl, qsl, D ** -0.5)
    n = dispatch.dispatch_counts[("paged_prefill_attention", "triton")]
    out, lse = K.paged_prefill_attention(*_to(device, q, kn, vn, kc, vc, table, pl, qsl),
                                         D ** -0.5)
    _ran_triton("paged_prefill_attention", n)
    assert_close(out, ref[0], dtype, "out")
    assert_lse(lse, ref[1], atol=LSE_ATOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_topk(g, device, dtype):
    lens, H, Dl, Dr, topk = [60, 25, 0], 4, 32, 16, 40
    lat = [rand(g, L, Dl + Dr, dtype=dtype) for L in lens]
    (cache,), table, _ = pack_sequences(lat, 16, g)
    req = torch.tensor([0, 0, 1, 2, 1], dtype=torch.int32)
    idx = torch.full((5, topk), -1, dtype=torch.int32)
    for t, b in enumerate(req.tolist()):
        k = min(lens[b], topk - 3 * t)
        idx[t, :k] = torch.randperm(lens[b], generator=g)[:k].to(torch.int32)
    q = rand(g, 5, H, Dl + Dr, dtype=dtype)
    scale = (Dl + Dr) ** -0.5
    ref = reference.sparse_topk_attention(q, cache, idx, table, req, scale, Dl)
    n = dispatch.dispatch_counts[("sparse_topk_attention", "triton")]
    out, lse = K.sparse_topk_attention(*_to(device, q, cache, idx, table, req), scale,
                                       kv_lora_rank=Dl)
    _ran_triton("sparse_topk_attention", n)
    assert_close(out, ref[0], dtype, "out")
    assert_lse(lse, ref[1], atol=LSE_ATOL)
    assert torch.all(lse[3].cpu() == float("-inf")) and torch.all(out[3].cpu() == 0)


def test_empty_batches(device):
    q = torch.zeros(0, 4, 64, device=device)
    kc = torch.zeros(2, 16, 2, 64, device=device)
    empty_i = torch.zeros(0, dtype=torch.int32, device=device)
    out, lse = K.paged_decode_attention(q, kc, kc, torch.zeros(0, 3, dtype=torch.int32,
                                                               device=device), empty_i, 0.1)
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)
    K.reshape_and_cache(torch.zeros(0, 2, 64, device=device), torch.zeros(0, 2, 64,
                        device=device), kc, kc, torch.zeros(0, dtype=torch.int64, device=device))


def test_dcp_decode_and_merge(g, device):
    """DCP end to end on the Triton path: per-rank partial decode over token-interleaved
    shards (some empty), merged, equals the reference decode over the whole sequence."""
    N, interleave, Hq, Hkv, D, dtype = 4, 4, 8, 1, 64, torch.bfloat16
    lens = [50, 6]
    q, kc, vc, table, sl, ks, vs = gqa_case(g, lens, Hq, Hkv, D, 8, dtype)
    full = reference.paged_decode_attention(q, kc, vc, table, sl, D ** -0.5)
    outs, lses = [], []
    for r in range(N):
        local = []
        for k, v in zip(ks, vs):
            idx = [i for i in range(k.shape[0]) if (i // interleave) % N == r]
            local.append((k[idx], v[idx]))
        (lk, lv), lt, ll = pack_sequences(local, 8, g)
        o, ls = K.paged_decode_attention(*_to(device, q, lk, lv, lt, ll), D ** -0.5)
        outs.append(o)
        lses.append(ls)
    out, lse = K.merge_attn_states(torch.stack(outs), torch.stack(lses))
    assert K.last_backend["merge_attn_states"] == "triton"
    assert_close(out, full[0], dtype, "merged out")
    assert_lse(lse, full[1], atol=LSE_ATOL)


def test_tiny_model_shapes(g, device):
    """The tiny-* presets' shapes (head_dim 16; MLA latent 32 + 8 rope dims), fp32: the
    head and rope dims are padded to 16-wide tiles and masked."""
    dtype = torch.float32
    q, kc, vc, table, sl, _, _ = gqa_case(g, [21, 3, 0], 4, 2, 16, 16, dtype)
    ref = reference.paged_decode_attention(q, kc, vc, table, sl, 0.25)
    out, lse = K.paged_decode_attention(*_to(device, q, kc, vc, table, sl), 0.25)
    assert_close(out, ref[0], dtype, "gqa out")
    assert_lse(lse, ref[1], atol=LSE_ATOL)

    lat = [rand(g, L, 40) for L in (21, 3, 0)]
    (cache,), table, sl = pack_sequences(lat, 16, g)
    ql = rand(g, 3, 4, 40)
    ref = reference.mla_paged_decode(ql[:, None], cache, table, sl, 0.2, 32)
    out, lse = K.mla_paged_decode(*_to(device, ql, cache, table, sl), 0.2, kv_lora_rank=32)
    assert_close(out, ref[0][:, 0], dtype, "mla out")
    assert_lse(lse, ref[1][:, 0], atol=LSE_ATOL)

    idx = torch.tensor([[0, 5, 20, -1], [2, 1, 0, -1], [-1, -1, -1, -1]], dtype=torch.int32)
    req = torch.tensor([0, 1, 2], dtype=torch.int32)
    ref = reference.sparse_topk_attention(ql, cache, idx, table, req, 0.2, 32)
    out, lse = K.sparse_topk_attention(*_to(device, ql, cache, idx, table, req), 0.2,
                                       kv_lora_rank=32)
    assert_close(out, ref[0], dtype, "sparse out")
    assert_lse(lse, ref[1], atol=LSE_ATOL)


def test_wrong_max_seq_len_hint_costs_speed_not_correctness(g, device):
    q, kc, vc, table, sl, _, _ = gqa_case(g, [90, 40], 8, 2, 64, 16, torch.float32)
    ref = reference.paged_decode_attention(q, kc, vc, table, sl, 0.125)
    out, lse = K.paged_decode_attention(*_to(device, q, kc, vc, table, sl), 0.125,
                                        max_seq_len=20, num_splits=2)
    assert_close(out, ref[0], torch.float32, "out")
    assert_lse(lse, ref[1], atol=LSE_ATOL)
    lat = [rand(g, L, 48) for L in (70, 9)]
    (cache,), table, sl = pack_sequences(lat, 16, g)
    ql = rand(g, 2, 4, 48)
    ref = reference.mla_paged_decode(ql[:, None], cache, table, sl, 0.2, 32)
    out, lse = K.mla_paged_decode(*_to(device, ql, cache, table, sl), 0.2, kv_lora_rank=32,
                                  max_seq_len=16)
    assert_close(out, ref[0][:, 0], torch.float32, "mla out")
    assert_lse(lse, ref[1][:, 0], atol=LSE_ATOL)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU interpreter path")
def test_triton_interpret_env_at_import():
    """TRITON_INTERPRET=1 from the start: the kernels module itself is interpreted (no
    second copy), and Triton is what ran."""
    import os
    import subprocess
    import sys

    code = (
        "import torch, sys\n"
        "import labkit.kernels as K\n"
        "from labkit.kernels import dispatch\n"
        "q = torch.randn(1, 2, 16); kc = torch.randn(2, 4, 1, 16)\n"
        "K.paged_decode_attention(q, kc, kc, torch.tensor([[1, 0]], dtype=torch.int32),\n"
        "                         torch.tensor([6], dtype=torch.int32), 0.25)\n"
        "assert K.last_backend['paged_decode_attention'] == 'triton'\n"
        "assert dispatch.triton_module(interpret=True) is dispatch.triton_module()\n"
        "assert dispatch.triton_module().interpreted()\n"
        "assert 'labkit.kernels._triton_impl_interpreted' not in sys.modules\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="1", LABKIT_KERNELS="triton",
               TRITON_DEFAULT_FP_FUSION="1")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
