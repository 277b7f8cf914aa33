"""The shapes `labkit bench kernels` times, and the baselines it compares them with.

Each `Case` names a kernel and a shape and builds, on a device, the call to time, the
bytes it must move, its FLOPs and its baselines: torch SDPA (fused backends only) on
equivalent contiguous tensors, FlashAttention's `flash_attn_with_kvcache` when it is
importable, or a plain torch version. Shapes (`default_cases`): contexts 4K-128K, batch
1-256; Llama-3.1-70B GQA per GPU at tp8 = 8 query heads / 1 KV head, Llama-3.1-8B =
32 / 8; DeepSeek MLA with 16 heads (128 at tp8) and 128 heads (dp attention), latent
512 + 64; DSA top-2048. Block tables are fragmented: each request's blocks are random
physical blocks.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

GIB = 1024 ** 3
MLA_SCALE = (128 + 64) ** -0.5  # DeepSeek: qk_nope + qk_rope head dim


def _flash_attn():
    try:
        from flash_attn import flash_attn_with_kvcache  # type: ignore
    except Exception:
        return None
    return flash_attn_with_kvcache


def _sdpa(q, k, v, **kw) -> dict:
    """{label: callable} running torch SDPA on q[B, Hq, Lq, D], k/v[B, Hkv, L, D] with its
    fused backends only (flash, memory-efficient, cuDNN: never the O(L^2)-memory math
    path). GQA through enable_gqa; if no fused backend takes that, K/V heads are expanded
    (more bytes read: the label says so)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
             SDPBackend.CUDNN_ATTENTION]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    gqa = q.shape[1] != k.shape[1]

    def run(qq, kk, vv, **extra):
        with sdpa_kernel(fused), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "flash attention not used because ..."
            return sdpa(qq, kk, vv, **kw, **extra)

    try:
        run(q, k, v, enable_gqa=gqa)
        return {"sdpa": lambda: run(q, k, v, enable_gqa=gqa)}
    except (RuntimeError, TypeError, ValueError):
        if not gqa:
            raise
    rep = q.shape[1] // k.shape[1]
    if (k.numel() + v.numel()) * rep * k.element_size() > 16 * GIB:
        raise RuntimeError("no fused SDPA backend takes GQA here, and expanded K/V > 16 GiB")
    ke, ve = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    run(q, ke, ve)
    return {"sdpa(kv heads expanded)": lambda: run(q, ke, ve)}


def _latent_baselines(q4, k, Dl, scale, mask=None) -> dict:
    """Contiguous equivalents of latent attention: q4[B, H, Q, Dc] against one shared
    latent "KV head" k[B, 1, L, Dc], values its first Dl dims. torch SDPA's fused
    backends if one takes it (value dim != key dim, head dim 576 are often refused), else
    SDPA with the whole latent as value, else plain torch matmul + softmax."""
    kw = {"scale": scale}
    if mask is not None:
        kw["attn_mask"] = mask
    for label, v in (("sdpa", k[..., :Dl]), ("sdpa(v = whole latent)", k)):
        try:
            fns = _sdpa(q4, k, v, **kw)
        except (RuntimeError, TypeError, ValueError):
            continue
        return {label if name == "sdpa" else f"{label}, {name}": fn for name, fn in fns.items()}
    kt, v = k.transpose(-1, -2), k[..., :Dl]
    bias = None if mask is None else torch.zeros(
        mask.seq_len_q, mask.seq_len_kv, device=k.device).masked_fill(
        ~torch.ones(mask.seq_len_q, mask.seq_len_kv, dtype=torch.bool, device=k.device)
        .tril(mask.seq_len_kv - mask.seq_len_q), float("-inf"))

    def naive():
        s = torch.matmul(q4, kt).float() * scale
        if bias is not None:
            s = s + bias
        return torch.matmul(torch.softmax(s, dim=-1).to(k.dtype), v)
    return {"torch matmul+softmax": naive}


def _k(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _paged_table(B: int, blocks_per_req: int, device, g) -> tuple[torch.Tensor, int]:
    """A fragmented block table: each request's blocks are random physical blocks."""
    nb = B * blocks_per_req
    perm = torch.randperm(nb, generator=g).to(device=device, dtype=torch.int32)
    return perm.view(B, blocks_per_req), nb


def _latent_cache(rows: int, ctx: int, Dc: int, page: int, dtype, dev, g):
    """A paged latent cache holding `ctx` tokens for each of `rows` requests."""
    table, nb = _paged_table(rows, math.ceil(ctx / page), dev, g)
    return table, torch.randn(nb, page, Dc, dtype=dtype, device=dev)


def _decode_baselines_gqa(dev, B, ctx, Hq, Hkv, D, dtype, scale, sl):
    out = {}
    q4 = torch.randn(B, Hq, 1, D, dtype=dtype, device=dev)
    k = torch.randn(B, Hkv, ctx, D, dtype=dtype, device=dev)
    v = torch.randn_like(k)
    out.update(_sdpa(q4, k, v, scale=scale))
    fa = _flash_attn()
    if fa is not None:
        kf, vf = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
        qf = q4.transpose(1, 2).contiguous()
        out["flash_attn"] = lambda: fa(qf, kf, vf, cache_seqlens=sl, softmax_scale=scale)
    return out


@dataclass
class Case:
    kernel: str
    shape: str
    setup: Callable  # () -> (ours: callable, bytes, flops, baselines: () -> dict)


def gqa_decode(B, ctx, Hq, Hkv, D, page=16, dtype=torch.bfloat16) -> Case:
    def setup(dev, g):
        from labkit.kernels import paged_decode_attention

        nblk = math.ceil(ctx / page)
        table, nb = _paged_table(B, nblk, dev, g)
        kc = torch.randn(nb, page, Hkv, D, dtype=dtype, device=dev)
        vc = torch.randn_like(kc)
        q = torch.randn(B, Hq, D, dtype=dtype, device=dev)
        sl = torch.full((B,), ctx, dtype=torch.int32, device=dev)
        scale = D ** -0.5
        elt = kc.element_size()
        nbytes = (2 * B * ctx * Hkv * D * elt + 2 * q.numel() * elt + table.numel() * 4
                  + B * Hq * 4)
        flops = 4 * B * Hq * ctx * D

        def ours():
            return paged_decode_attention(q, kc, vc, table, sl, scale, max_seq_len=ctx)

        def baselines():
            return _decode_baselines_gqa(dev, B, ctx, Hq, Hkv, D, dtype, scale, sl)

        return ours, nbytes, flops, baselines

    return Case("paged_decode_attention",
                f"B={B:<3} ctx={_k(ctx):>4} Hq={Hq} Hkv={Hkv} D={D} page={page}", setup)


def mla_decode(B, ctx, H, Q=1, Dl=512, Dr=64, page=64, dtype=torch.bfloat16) -> Case:
    def setup(dev, g):
        from labkit.kernels import mla_paged_decode

        table, cache = _latent_cache(B, ctx, Dl + Dr, page, dtype, dev, g)
        q = torch.randn(B, Q, H, Dl + Dr, dtype=dtype, device=dev)
        sl = torch.full((B,), ctx, dtype=torch.int32, device=dev)
        scale = MLA_SCALE
        elt = cache.element_size()
        nbytes = (B * ctx * (Dl + Dr) * elt + q.numel() * elt + B * Q * H * Dl * elt
                  + table.numel() * 4 + B * Q * H * 4)
        flops = 2 * B * Q * H * ctx * (2 * Dl + Dr)
        qq = q if Q > 1 else q[:, 0]

        def ours():
            return mla_paged_decode(qq, cache, table, sl, scale, kv_lora_rank=Dl, max_seq_len=ctx)

        def baselines():
            # contiguous equivalent: MQA with one latent "KV head", values = first Dl dims
            # (Q > 1: lower-right causal mask, as the kernel's speculative verify)
            k = torch.randn(B, 1, ctx, Dl + Dr, dtype=dtype, device=dev)
            q4 = q.transpose(1, 2)  # [B, H, Q, Dc]
            mask = None
            if Q > 1:
                from torch.nn.attention.bias import causal_lower_right
                mask = causal_lower_right(Q, ctx)
            return _latent_baselines(q4, k, Dl, scale, mask)

        return ours, nbytes, flops, baselines

    return Case("mla_paged_decode",
                f"B={B:<3} ctx={_k(ctx):>4} H={H} Q={Q} latent={Dl}+{Dr} page={page}", setup)


def sparse(T, ctx, H, topk=2048, Dl=512, Dr=64, page=64, dtype=torch.bfloat16) -> Case:
    def setup(dev, g):
        from labkit.kernels import sparse_topk_attention

        table, cache = _latent_cache(T, ctx, Dl + Dr, page, dtype, dev, g)  # a request per token
        q = torch.randn(T, H, Dl + Dr, dtype=dtype, device=dev)
        idx = torch.stack([torch.randperm(ctx, generator=g)[:topk] for _ in range(T)])
        idx = idx.to(device=dev, dtype=torch.int32)
        req = torch.arange(T, dtype=torch.int32, device=dev)
        scale = MLA_SCALE
        elt = cache.element_size()
        nbytes = (T * topk * (Dl + Dr) * elt + q.numel() * elt + T * H * Dl * elt
                  + idx.numel() * 4 + T * H * 4)
        flops = 2 * T * H * topk * (2 * Dl + Dr)

        def ours():
            return sparse_topk_attention(q, cache, idx, table, req, scale, kv_lora_rank=Dl)

        def baselines():
            # dense attention over the gathered (contiguous) top-k latents
            k = torch.randn(T, 1, topk, Dl + Dr, dtype=dtype, device=dev)
            return _latent_baselines(q.unsqueeze(2), k, Dl, scale)

        return ours, nbytes, flops, baselines

    return Case("sparse_topk_attention",
                f"T={T:<3} top-{topk} ctx={_k(ctx)} H={H} latent={Dl}+{Dr}", setup)


def merge(N, B, H, D, dtype=torch.bfloat16) -> Case:
    def setup(dev, g):
        from labkit.kernels import merge_attn_states

        outs = torch.randn(N, B, H, D, dtype=dtype, device=dev)
        lses = torch.randn(N, B, H, device=dev)
        elt = outs.element_size()
        nbytes = outs.numel() * elt + lses.numel() * 4 + B * H * D * elt + B * H * 4

        def ours():
            return merge_attn_states(outs, lses)

        def baselines():
            from labkit.kernels import reference
            return {"torch": lambda: reference.merge_attn_states(outs, lses)}

        return ours, nbytes, 0, baselines

    return Case("merge_attn_states", f"N={N} B={B} H={H} D={D}", setup)


def cache_write(T, Hkv, D, latent=False, page=16, dtype=torch.bfloat16) -> Case:
    def setup(dev, g):
        from labkit.kernels import reshape_and_cache, reshape_and_cache_latent

        nb = math.ceil(T / page) * 4
        slots = torch.randperm(nb * page, generator=g)[:T].to(dev)
        if latent:
            x = torch.randn(T, D, dtype=dtype, device=dev)
            cache = torch.zeros(nb, page, D, dtype=dtype, device=dev)
            nbytes = 2 * x.numel() * x.element_size() + T * 8

            def ours():
                reshape_and_cache_latent(x, cache, slots)

            def baselines():
                flat = cache.view(-1, D)
                return {"torch": lambda: flat.index_copy_(0, slots, x)}
        else:
            k = torch.randn(T, Hkv, D, dtype=dtype, device=dev)
            v = torch.randn_like(k)
            kc = torch.zeros(nb, page, Hkv, D, dtype=dtype, device=dev)
            vc = torch.zeros_like(kc)
            nbytes = 4 * k.numel() * k.element_size() + T * 8

            def ours():
                reshape_and_cache(k, v, kc, vc, slots)

            def baselines():
                fk, fv = kc.view(-1, Hkv, D), vc.view(-1, Hkv, D)
                return {"torch": lambda: (fk.index_copy_(0, slots, k),
                                          fv.index_copy_(0, slots, v))}
        return ours, nbytes, 0, baselines

    what = f"T={T} latent={D}" if latent else f"T={T} Hkv={Hkv} D={D}"
    return Case("reshape_and_cache" + ("_latent" if latent else ""), what, setup)


def prefill(prefix, new, Hq, Hkv, D, B=1, page=16, dtype=torch.bfloat16) -> Case:
    def setup(dev, g):
        from labkit.kernels import paged_prefill_attention

        nblk = max(1, math.ceil(prefix / page))
        table, nb = _paged_table(B, nblk, dev, g)
        kc = torch.randn(nb, page, Hkv, D, dtype=dtype, device=dev)
        vc = torch.randn_like(kc)
        T = B * new
        q = torch.randn(T, Hq, D, dtype=dtype, device=dev)
        kn = torch.randn(T, Hkv, D, dtype=dtype, device=dev)
        vn = torch.randn_like(kn)
        pl = torch.full((B,), prefix, dtype=torch.int32, device=dev)
        qsl = torch.arange(0, T + 1, new, dtype=torch.int32, device=dev)
        scale = D ** -0.5
        elt = q.element_size()
        nbytes = (2 * B * prefix * Hkv * D * elt + 2 * kn.numel() * elt + 2 * q.numel() * elt
                  + T * Hq * 4)
        flops = 4 * B * Hq * D * (new * prefix + new * (new + 1) / 2)

        def ours():
            return paged_prefill_attention(q, kn, vn, kc, vc, table, pl, qsl, scale,
                                           max_query_len=new)

        def baselines():
            from torch.nn.attention.bias import causal_lower_right
            qs = torch.randn(B, Hq, new, D, dtype=dtype, device=dev)
            k = torch.randn(B, Hkv, prefix + new, D, dtype=dtype, device=dev)
            v = torch.randn_like(k)
            mask = causal_lower_right(new, prefix + new)
            return _sdpa(qs, k, v, attn_mask=mask, scale=scale)

        return ours, nbytes, flops, baselines

    return Case("paged_prefill_attention",
                f"B={B} prefix={_k(prefix)} new={_k(new)} Hq={Hq} Hkv={Hkv} D={D}", setup)


def default_cases(quick: bool = False) -> list[Case]:
    K = 1024
    if quick:
        return [gqa_decode(1, 32 * K, 8, 1, 128), gqa_decode(64, 8 * K, 8, 1, 128),
                mla_decode(1, 32 * K, 16), mla_decode(64, 8 * K, 128),
                sparse(32, 32 * K, 16), merge(8, 256, 64, 128), cache_write(8192, 8, 128),
                prefill(16 * K, 4 * K, 32, 8, 128)]
    cases = []
    # Llama-3.1-70B at tp8 (8 q heads, 1 KV head per GPU) and Llama-3.1-8B (32 / 8)
    for B, ctx in ((1, 4 * K), (1, 32 * K), (1, 128 * K), (16, 32 * K), (32, 128 * K),
                   (64, 8 * K), (256, 4 * K), (256, 32 * K)):
        cases.append(gqa_decode(B, ctx, 8, 1, 128))
    for B, ctx in ((1, 128 * K), (16, 32 * K), (64, 8 * K)):
        cases.append(gqa_decode(B, ctx, 32, 8, 128))
    # DeepSeek-V3 MLA: 16 heads (tp8), 128 heads (dp attention); MTP verify with Q=4
    for H in (16, 128):
        for B, ctx in ((1, 4 * K), (1, 128 * K), (32, 32 * K), (128, 8 * K), (64, 128 * K)):
            cases.append(mla_decode(B, ctx, H))
    cases.append(mla_decode(64, 32 * K, 16, Q=4))
    # DeepSeek-V3.2 DSA: top-2048 of long contexts
    for T in (1, 32, 128):
        for H in (16, 128):
            cases.append(sparse(T, 32 * K, H))
    cases += [merge(8, 256, 64, 128), merge(8, 256, 16, 512), merge(2, 64, 8, 128)]
    cases += [cache_write(8192, 8, 128), cache_write(256, 1, 128),
              cache_write(8192, 1, 576, latent=True)]
    # chunked prefill of an agentic turn over a long cached prefix, and a cold prefill
    cases += [prefill(32 * K, 8 * K, 32, 8, 128), prefill(0, 8 * K, 32, 8, 128),
              prefill(128 * K, 2 * K, 8, 1, 128)]
    return cases
