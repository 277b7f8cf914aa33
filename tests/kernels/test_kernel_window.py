"""Sliding-window attention (`window=W`): the references and the Triton kernels against
naive float64 attention over each request's last W positions.

Every case poisons what lies before a request's window — table entries of whole blocks
set to -1 (as the KV manager leaves freed sliding-window blocks) or pointing at an
all-NaN block, and the stale positions of the first, partial block set to NaN — so a
kernel that reads anything outside the window returns NaN or fails. Triton runs under
the interpreter on CPU: the shapes stay tiny.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import (
    assert_close, assert_lse, naive_attention, pack_sequences, poison_before, rand,
    window_visible)

import labkit.kernels as K
from labkit.kernels import KernelArgumentError

LSE_ATOL = 2e-4
BS = 16
MODES = ["minus1", "nan_block"]


@pytest.fixture(params=["torch_backend", "triton_backend"])
def backend(request):
    return request.getfixturevalue(request.param)


def _decode_case(g, lens, W, Hq, Hkv, D, mode, dtype=torch.float32):
    ks = [rand(g, L, Hkv, D, dtype=dtype) for L in lens]
    vs = [rand(g, L, Hkv, D, dtype=dtype) for L in lens]
    (kc, vc), table, sl = pack_sequences(list(zip(ks, vs)), BS, g)
    first = [max(0, L - W) for L in lens]
    table = poison_before([kc, vc], table, first, BS, mode)
    q = rand(g, len(lens), Hq, D, dtype=dtype)
    return q, kc, vc, table, sl, ks, vs, first


def _decode_expected(q, ks, vs, first, scale):
    outs, lses = [], []
    for b, f in enumerate(first):
        o, ls = naive_attention(q[b:b + 1], ks[b][f:], vs[b][f:], scale)
        outs.append(o[0])
        lses.append(ls[0])
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("W", [20, 16, 1])
def test_windowed_decode_matches_naive(g, backend, mode, W):
    # 37 and 45: the window starts inside a block; 5 < W (except W = 1): all of it;
    # 0: an empty request; 100: several whole blocks before the window
    lens = [37, 0, 100, 45, 5]
    q, kc, vc, table, sl, ks, vs, first = _decode_case(g, lens, W, 4, 2, 16, mode)
    assert (table[2, :4] < 0).all() if mode == "minus1" else torch.isnan(kc).any()
    out, lse = K.paged_decode_attention(q, kc, vc, table, sl, 0.25, window=W, num_splits=2)
    assert K.last_backend["paged_decode_attention"] == backend
    eo, el = _decode_expected(q, ks, vs, first, 0.25)
    assert not torch.isnan(out).any()
    assert_close(out, eo, torch.float32, "out")
    assert_lse(lse, el, atol=LSE_ATOL)
    assert torch.all(out[1] == 0) and torch.all(lse[1] == float("-inf"))


def test_windowed_decode_bf16_default_splits(g, backend):
    lens = [70, 9]
    q, kc, vc, table, sl, ks, vs, first = _decode_case(g, lens, 24, 8, 2, 32, "minus1",
                                                       torch.bfloat16)
    out, lse = K.paged_decode_attention(q, kc, vc, table, sl, 0.2, window=24)
    eo, el = _decode_expected(q, ks, vs, first, 0.2)
    assert_close(out, eo, torch.bfloat16, "out")
    assert_lse(lse, el, atol=LSE_ATOL)


def test_window_covering_the_context_is_full_attention(g, torch_backend):
    """An independent cross-check of the window's boundary: W >= length changes
    nothing, W = length - 1 drops exactly position 0."""
    lens = [30, 12]
    ks = [rand(g, L, 2, 16) for L in lens]
    vs = [rand(g, L, 2, 16) for L in lens]
    (kc, vc), table, sl = pack_sequences(list(zip(ks, vs)), BS, g)
    q = rand(g, 2, 4, 16)
    full = K.paged_decode_attention(q, kc, vc, table, sl, 0.25)
    same = K.paged_decode_attention(q, kc, vc, table, sl, 0.25, window=30)
    torch.testing.assert_close(same, full)
    shorter = K.paged_decode_attention(q, kc, vc, table, sl, 0.25, window=29)
    torch.testing.assert_close(shorter[0][1], full[0][1])  # 12 <= 29: unchanged
    assert (shorter[0][0] - full[0][0]).abs().max() > 1e-4
    o, ls = naive_attention(q[:1], ks[0][1:], vs[0][1:], 0.25)
    assert_close(shorter[0][:1], o, torch.float32)
    assert_lse(shorter[1][:1], ls)


def _prefill_case(g, prefix, new, W, Hq, Hkv, D, mode):
    kp = [rand(g, P, Hkv, D) for P in prefix]
    vp = [rand(g, P, Hkv, D) for P in prefix]
    (kc, vc), table, pl = pack_sequences(list(zip(kp, vp)), BS, g)
    first = [max(0, P - W + 1) for P in prefix]  # the first new token's window
    table = poison_before([kc, vc], table, first, BS, mode)
    T = sum(new)
    q, kn, vn = rand(g, T, Hq, D), rand(g, T, Hkv, D), rand(g, T, Hkv, D)
    qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    return q, kn, vn, kc, vc, table, pl, qsl, kp, vp


def _prefill_expected(q, kn, vn, kp, vp, qsl, W, scale):
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
    for b in range(len(kp)):
        s, e = int(qsl[b]), int(qsl[b + 1])
        k, v = torch.cat([kp[b], kn[s:e]]), torch.cat([vp[b], vn[s:e]])
        visible = window_visible(e - s, kp[b].shape[0], W)
        out[s:e], lse[s:e] = naive_attention(q[s:e], k, v, scale, visible)
    return out, lse


@pytest.mark.parametrize("mode", MODES)
def test_windowed_prefill_matches_naive(g, backend, mode):
    # prefix 40 / 33: blocks before the window; 0: a fresh prompt of 40 tokens (two
    # 32-row Triton tiles: the second tile's window starts past the first's); a decode
    # step (1 new token) and an empty request
    prefix, new, W = [33, 0, 16, 5, 40], [7, 40, 0, 1, 3], 20
    q, kn, vn, kc, vc, table, pl, qsl, kp, vp = _prefill_case(g, prefix, new, W, 4, 2, 16,
                                                              mode)
    out, lse = K.paged_prefill_attention(q, kn, vn, kc, vc, table, pl, qsl, 0.25, window=W)
    assert K.last_backend["paged_prefill_attention"] == backend
    eo, el = _prefill_expected(q, kn, vn, kp, vp, qsl, W, 0.25)
    assert not torch.isnan(out).any()
    assert_close(out, eo, torch.float32, "out")
    assert_lse(lse, el, atol=LSE_ATOL)


def test_windowed_prefill_of_one_token_is_windowed_decode(g, torch_backend):
    """A chunk of one new token over the cached prefix == decode of that token."""
    W = 10
    q, kn, vn, kc, vc, table, pl, qsl, kp, vp = _prefill_case(g, [29, 12], [1, 1], W, 4, 2,
                                                              16, "minus1")
    out_p, lse_p = K.paged_prefill_attention(q, kn, vn, kc, vc, table, pl, qsl, 0.25,
                                             window=W)
    for b, P in enumerate([29, 12]):  # put the new token in the cache, decode it
        blk = int(table[b, P // BS])
        kc[blk, P % BS], vc[blk, P % BS] = kn[b], vn[b]
    out_d, lse_d = K.paged_decode_attention(q, kc, vc, table, pl + 1, 0.25, window=W)
    torch.testing.assert_close(out_p, out_d, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_p, lse_d, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------- argument checks
def _decode_args(window, table):
    return dict(q=torch.zeros(1, 4, 16), k_cache=torch.zeros(4, BS, 2, 16),
                v_cache=torch.zeros(4, BS, 2, 16), block_table=torch.tensor([table],
                                                                            dtype=torch.int32),
                seq_lens=torch.tensor([40], dtype=torch.int32), scale=0.25, window=window)


@pytest.mark.parametrize("window", [-1, True, 2.0])
def test_bad_window_is_rejected(torch_backend, window):
    with pytest.raises(KernelArgumentError, match=r"window must be an int >= 0"):
        K.paged_decode_attention(**_decode_args(window, [0, 1, 2]))


def test_only_entries_inside_the_window_must_be_blocks(torch_backend):
    """40 tokens, window 24: positions 16..39 live in blocks 1 and 2; block 0 may be -1."""
    K.paged_decode_attention(**_decode_args(24, [-1, 1, 2]))
    with pytest.raises(KernelArgumentError, match=r"block_table\[0, 0\] = -1 is used"):
        K.paged_decode_attention(**_decode_args(25, [-1, 1, 2]))  # position 15: block 0
    with pytest.raises(KernelArgumentError, match=r"block_table\[0, 0\] = -1 is used"):
        K.paged_decode_attention(**_decode_args(0, [-1, 1, 2]))
