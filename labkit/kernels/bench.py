"""`labkit bench kernels`: time the Triton kernels on a GPU.

For each kernel, over realistic shapes (`bench_cases.py`: contexts 4K-128K, batch
1-256, Llama GQA, DeepSeek MLA, DSA top-2048): the
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

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from labkit.kernels.bench_cases import GIB, Case, default_cases


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


@dataclass
class Row:
    kernel: str
    shape: str
    seconds: float
    bytes: float
    baseline: dict  # name -> seconds
    flops: float = 0.0


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
