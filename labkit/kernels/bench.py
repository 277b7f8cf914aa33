"""`labkit bench kernels`: time the Triton kernels on a GPU.

For each kernel, over realistic shapes (contexts 4K-128K, batch 1-256; Llama-3.1-70B
GQA per GPU at tp8 = 8 query heads / 1 KV head, Llama-3.1-8B = 32 / 8; DeepSeek MLA with
16 heads (128 at tp8) and 128 heads (dp attention), latent 512 + 64; DSA top-2048): the
median of timed repeats with CUDA events after warm-up (L2 flushed before every timed
call), the **bytes the kernel must move** (K/V or latent it reads, queries, outputs,
tables) over that time as a fraction of the GPU's peak HBM bandwidth, and the ratio to
`torch.nn.functional.scaled_dot_product_attention` on equivalent contiguous tensors
(and to FlashAttention's `flash_attn_with_kvcache` when `flash_attn` is importable).
A ratio > 1 means the paged kernel is faster than the contiguous baseline.

The peak comes from `labkit.specs.get_hardware` when the device name says H100 (SXM),
H200 or B200, else from torch's device properties (2 x memory clock x bus width).
Without CUDA it says so and returns 0.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

GIB = 1024 ** 3


# ------------------------------------------------------------------------- plumbing


def hbm_peak(device) -> tuple[float | None, str]:
    """(peak HBM bytes/s, where the number comes from) for a CUDA device."""
    from labkit.specs import get_hardware

    name = torch.cuda.get_device_name(device)
    low = name.lower()
    for key in ("b200", "h200", "h100"):
        if key in low and not ("pcie" in low or "nvl" in low):
            return get_hardware(key).hbm_bandwidth, f"labkit.specs '{key}' datasheet"
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", 0) or 0
    bus_bits = getattr(props, "memory_bus_width", 0) or 0
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8, "torch device properties (2 x clock x bus)"
    return None, "unknown (torch exposes no memory clock)"


class Timer:
    """Median wall time of a callable: CUDA events on a GPU (L2 flushed before each
    timed call), perf_counter elsewhere (used only by the CPU smoke test)."""

    def __init__(self, device, warmup: int = 3, repeats: int = 20):
        self.device = torch.device(device)
        self.warmup, self.repeats = warmup, repeats
        self.cuda = self.device.type == "cuda"
        self._flush = (torch.empty(256 * 2**20, dtype=torch.int8, device=self.device)
                       if self.cuda else None)

    def __call__(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        if self.cuda:
            torch.cuda.synchronize(self.device)
            for _ in range(self.repeats):
                self._flush.zero_()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
        else:
            for _ in range(self.repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


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


@dataclass
class Row:
    kernel: str
    shape: str
    seconds: float
    bytes: float
    baseline: dict  # name -> seconds
    flops: float = 0.0


# ------------------------------------------------------------------------- cases


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

        nblk = math.ceil(ctx / page)
        table, nb = _paged_table(B, nblk, dev, g)
        cache = torch.randn(nb, page, Dl + Dr, dtype=dtype, device=dev)
        q = torch.randn(B, Q, H, Dl + Dr, dtype=dtype, device=dev)
        sl = torch.full((B,), ctx, dtype=torch.int32, device=dev)
        scale = (128 + 64) ** -0.5  # DeepSeek: qk_nope + qk_rope head dim
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

        nblk = math.ceil(ctx / page)
        table, nb = _paged_table(T, nblk, dev, g)  # one request per decode token
        cache = torch.randn(nb, page, Dl + Dr, dtype=dtype, device=dev)
        q = torch.randn(T, H, Dl + Dr, dtype=dtype, device=dev)
        idx = torch.stack([torch.randperm(ctx, generator=g)[:topk] for _ in range(T)])
        idx = idx.to(device=dev, dtype=torch.int32)
        req = torch.arange(T, dtype=torch.int32, device=dev)
        scale = (128 + 64) ** -0.5
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


# ------------------------------------------------------------------------- driver


def run_cases(cases: list[Case], device, timer: Timer, printer=print) -> list[Row]:
    """Time every case (ours, then each baseline); a case that fails prints why."""
    g = torch.Generator().manual_seed(0)
    rows: list[Row] = []
    for case in cases:
        try:
            ours, nbytes, flops, baselines = case.setup(device, g)
            t = timer(ours)
            base = {}
            try:
                for name, fn in baselines().items():
                    try:
                        base[name] = timer(fn)
                    except Exception as e:  # a baseline that does not support the case
                        base[name] = f"n/a ({type(e).__name__})"
            except Exception as e:
                base["baseline"] = f"n/a ({type(e).__name__}: {e})"
            rows.append(Row(case.kernel, case.shape, t, nbytes, base, flops))
        except torch.cuda.OutOfMemoryError:
            printer(f"  {case.kernel:<24} {case.shape}: out of memory, skipped")
        except Exception as e:
            printer(f"  {case.kernel:<24} {case.shape}: FAILED {type(e).__name__}: {e}")
        finally:
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()
    return rows


def format_rows(rows: list[Row], peak: float | None) -> list[str]:
    lines = []
    kernel = None
    for r in rows:
        if r.kernel != kernel:
            kernel = r.kernel
            lines.append("")
            lines.append(f"{kernel}")
            lines.append(f"  {'shape':<52} {'time':>10} {'GB/s':>8} {'%peak':>6} "
                         f"{'TFLOP/s':>8}  vs baselines (their time / ours)")
        bw = r.bytes / r.seconds
        pct = f"{100 * bw / peak:5.1f}%" if peak else "   n/a"
        tf = f"{r.flops / r.seconds / 1e12:8.1f}" if r.flops else f"{'':>8}"
        base = []
        for name, t in r.baseline.items():
            if isinstance(t, float):
                base.append(f"{name} {t * 1e3:.3f} ms = {t / r.seconds:.2f}x")
            else:
                base.append(f"{name} {t}")
        lines.append(f"  {r.shape:<52} {r.seconds * 1e3:8.3f}ms {bw / 1e9:8.0f} {pct} {tf}  "
                     + "; ".join(base))
    return lines


def bench_kernels(quick: bool = False) -> int:
    """Print the kernel benchmark (needs CUDA; without it, says so and returns 0)."""
    if not torch.cuda.is_available():
        print("labkit bench kernels: needs a CUDA GPU (torch sees none); nothing to time.")
        return 0
    import triton

    from labkit.kernels import dispatch

    dev = torch.device("cuda")
    peak, source = hbm_peak(dev)
    props = torch.cuda.get_device_properties(dev)
    print(f"labkit bench kernels on {torch.cuda.get_device_name(dev)} "
          f"({props.multi_processor_count} SMs, {props.total_memory / GIB:.0f} GiB); "
          f"torch {torch.__version__}, triton {triton.__version__}")
    print(f"peak HBM bandwidth: {peak / 1e12:.2f} TB/s ({source})" if peak else
          f"peak HBM bandwidth: {source}")
    print("bytes = what the kernel must read and write (KV/latent, queries, outputs, tables); "
          "median of 20 timed calls after 3 warm-ups, L2 flushed before each; bf16")
    if dispatch.requested_backend() == "torch":
        print("note: LABKIT_KERNELS=torch: timing the torch references, not Triton")
    rows = run_cases(default_cases(quick), dev, Timer(dev))
    for line in format_rows(rows, peak):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(bench_kernels())
