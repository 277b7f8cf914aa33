"""Wrong shapes, dtypes, devices and values get a clear ValueError before anything runs."""

from __future__ import annotations

import pytest
import torch

import labkit.kernels as K
from labkit.kernels import KernelArgumentError

I32 = torch.int32
Err = KernelArgumentError


def decode_args(**over):
    args = dict(q=torch.zeros(2, 8, 64), k_cache=torch.zeros(4, 16, 2, 64),
                v_cache=torch.zeros(4, 16, 2, 64),
                block_table=torch.tensor([[0, 1], [2, 99]], dtype=I32),
                seq_lens=torch.tensor([20, 16], dtype=I32), scale=0.125)
    args.update(over)
    return args


@pytest.mark.parametrize("over,match", [
    (dict(q=torch.zeros(2, 8)), r"q must be 3-D \[B,Hq,D\], got shape \(2, 8\)"),
    (dict(q=torch.zeros(2, 8, 64, dtype=torch.int32)), r"q must have dtype float32 or bfloat16"),
    (dict(q=torch.zeros(2, 8, 64, dtype=torch.float64)), r"q must have dtype float32"),
    (dict(k_cache=torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)),
     r"k_cache must have the same dtype as q"),
    (dict(k_cache=torch.zeros(4, 16, 2, 32)), r"k_cache.shape\[3\] \(head_dim\) must be 64"),
    (dict(v_cache=torch.zeros(4, 16, 2, 32)), r"v_cache must have k_cache's shape"),
    (dict(k_cache=torch.zeros(4, 16, 3, 64), v_cache=torch.zeros(4, 16, 3, 64)),
     r"q's 8 heads must be a multiple of k_cache's 3 KV heads"),
    (dict(block_table=torch.tensor([[0, 1], [2, 3]])),
     r"block_table must have dtype int32, got torch.int64"),
    (dict(block_table=torch.zeros(3, 2, dtype=I32)), r"block_table.shape\[0\] \(batch\) must be 2"),
    (dict(seq_lens=torch.tensor([20], dtype=I32)), r"seq_lens.shape\[0\] \(batch\) must be 2"),
    (dict(seq_lens=torch.tensor([20, 33], dtype=I32)), r"seq_lens has 33 > 32"),
    (dict(seq_lens=torch.tensor([20, -1], dtype=I32)), r"seq_lens must be >= 0"),
    (dict(seq_lens=torch.tensor([20, 17], dtype=I32)), r"block_table\[1, 1\] = 99 is used"),
    (dict(k_cache=torch.zeros(4, 16, 64, 2).transpose(2, 3)),
     r"k_cache must be contiguous in its last"),
    (dict(scale="0.1"), r"scale must be a real number"),
    (dict(scale=0.0), r"scale must be a positive finite number"),
    (dict(q=torch.zeros(2, 8, 64, device="meta")), r"k_cache is on cpu but q is on meta"),
    (dict(q=[1, 2]), r"q must be a torch.Tensor"),
])
def test_paged_decode_rejects(over, match):
    with pytest.raises(Err, match=r"^paged_decode_attention: " + match):
        K.paged_decode_attention(**decode_args(**over))


def test_errors_are_value_errors():
    assert issubclass(KernelArgumentError, ValueError)
    with pytest.raises(ValueError):
        K.paged_decode_attention(**decode_args(q=torch.zeros(3)))


def test_garbage_beyond_the_used_entries_is_fine():
    out, lse = K.paged_decode_attention(**decode_args())
    assert out.shape == (2, 8, 64) and lse.shape == (2, 8)


def test_mla_rejects():
    q = torch.zeros(2, 4, 48)
    cache = torch.zeros(3, 8, 48)
    bt = torch.zeros(2, 2, dtype=I32)
    sl = torch.tensor([3, 4], dtype=I32)
    with pytest.raises(Err, match=r"kv_lora_rank must be an int in \[1, 48\]"):
        K.mla_paged_decode(q, cache, bt, sl, 0.1)  # default 512 > 48
    with pytest.raises(Err, match=r"latent_cache.shape\[2\] \(latent dim\) must be 48"):
        K.mla_paged_decode(q, torch.zeros(3, 8, 40), bt, sl, 0.1, kv_lora_rank=32)
    with pytest.raises(Err, match=r"q_latent must be 4-D \[B,Q,H,Dl\+Dr\]"):
        K.mla_paged_decode(torch.zeros(2, 48), cache, bt, sl, 0.1, kv_lora_rank=32)


def test_merge_rejects():
    with pytest.raises(Err, match=r"lses must have shape \[N, B, H\] = \(2, 3, 4\)"):
        K.merge_attn_states(torch.zeros(2, 3, 4, 8), torch.zeros(2, 3, 5))
    with pytest.raises(Err, match=r"lses must have dtype float32"):
        K.merge_attn_states(torch.zeros(2, 3, 4, 8), torch.zeros(2, 3, 4, dtype=torch.bfloat16))
    with pytest.raises(Err, match=r"at least one partial"):
        K.merge_attn_states(torch.zeros(0, 3, 4, 8), torch.zeros(0, 3, 4))


def test_reshape_and_cache_rejects():
    k = torch.zeros(3, 2, 8)
    kc = torch.zeros(4, 4, 2, 8)
    with pytest.raises(Err, match=r"slot_mapping holds slot 16 but the cache has 16"):
        K.reshape_and_cache(k, k, kc, kc, torch.tensor([0, -1, 16]))
    with pytest.raises(Err, match=r"slot_mapping must have dtype int32 or int64"):
        K.reshape_and_cache(k, k, kc, kc, torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(Err, match=r"slot_mapping.shape\[0\] \(tokens\) must be 3"):
        K.reshape_and_cache(k, k, kc, kc, torch.tensor([0, 1]))
    with pytest.raises(Err, match=r"k_cache.shape\[2\] \(Hkv\) must be 2"):
        K.reshape_and_cache(k, k, torch.zeros(4, 4, 1, 8), torch.zeros(4, 4, 1, 8),
                            torch.tensor([0, 1, 2]))
    with pytest.raises(Err, match=r"^reshape_and_cache_latent: latent_cache.shape\[2\]"):
        K.reshape_and_cache_latent(torch.zeros(3, 8), torch.zeros(4, 4, 9), torch.tensor([0, 1, 2]))


def test_prefill_rejects():
    q = torch.zeros(5, 4, 16)
    kn = torch.zeros(5, 2, 16)
    kc = torch.zeros(4, 4, 2, 16)
    bt = torch.zeros(2, 3, dtype=I32)
    pl = torch.tensor([2, 0], dtype=I32)
    with pytest.raises(Err, match=r"query_start_loc must rise from 0 to T = 5"):
        K.paged_prefill_attention(q, kn, kn, kc, kc, bt, pl, torch.tensor([0, 3, 4], dtype=I32),
                                  0.1)
    with pytest.raises(Err, match=r"query_start_loc.shape\[0\] \(batch \+ 1\) must be 3"):
        K.paged_prefill_attention(q, kn, kn, kc, kc, bt, pl, torch.tensor([0, 5], dtype=I32), 0.1)
    with pytest.raises(Err, match=r"max_query_len \(2\) is below the longest request's 3"):
        K.paged_prefill_attention(q, kn, kn, kc, kc, bt, pl, torch.tensor([0, 3, 5], dtype=I32),
                                  0.1, max_query_len=2)
    with pytest.raises(Err, match=r"k_new and v_new must have shape \[T, Hkv, D\]"):
        K.paged_prefill_attention(q, kn[:4], kn, kc, kc, bt, pl,
                                  torch.tensor([0, 3, 5], dtype=I32), 0.1)


def test_sparse_rejects():
    q = torch.zeros(3, 4, 48)
    cache = torch.zeros(4, 8, 48)
    bt = torch.tensor([[0, 1], [2, 3]], dtype=I32)
    idx = torch.tensor([[0, 5, -1], [1, 2, 3], [15, -1, -1]], dtype=I32)
    req = torch.tensor([0, 1, 1], dtype=I32)
    out, _ = K.sparse_topk_attention(q, cache, idx, bt, req, 0.1, kv_lora_rank=32)
    assert out.shape == (3, 4, 32)
    with pytest.raises(Err, match=r"token_to_req must name rows of block_table"):
        K.sparse_topk_attention(q, cache, idx, bt, torch.tensor([0, 1, 2], dtype=I32), 0.1,
                                kv_lora_rank=32)
    with pytest.raises(Err, match=r"topk_indices holds position 16"):
        K.sparse_topk_attention(q, cache, idx + 1, bt, req, 0.1, kv_lora_rank=32)
    with pytest.raises(Err, match=r"topk_indices must have dtype int32"):
        K.sparse_topk_attention(q, cache, idx.long(), bt, req, 0.1, kv_lora_rank=32)


def test_unknown_backend(monkeypatch):
    monkeypatch.setenv("LABKIT_KERNELS", "cuda-magic")
    with pytest.raises(ValueError, match=r"LABKIT_KERNELS='cuda-magic' .* auto, triton, torch"):
        K.merge_attn_states(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1))


def test_auto_uses_the_reference_on_cpu(monkeypatch):
    monkeypatch.delenv("LABKIT_KERNELS", raising=False)
    K.merge_attn_states(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1))
    assert K.last_backend["merge_attn_states"] == "torch"
