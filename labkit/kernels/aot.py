"""Compile the Triton kernels for a GPU without having one (a CI / laptop check).

The interpreter (TRITON_INTERPRET=1) runs the kernels' Python, not the compiler: code it
accepts may still fail to compile, or compile to something that spills registers. This
module runs the launchers on CPU tensors with each kernel replaced by a recorder, then
compiles every recorded launch (same arguments, constexprs, num_warps and num_stages)
for an NVIDIA target with Triton's bundled ptxas, and reports registers and spills.

Needs Triton *compiled* mode: run it in a process without TRITON_INTERPRET=1
(`python -m labkit.kernels.aot`).
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import tempfile

import torch

_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
          torch.int32: "i32", torch.int64: "i64"}


class _Recorder:
    def __init__(self, kernel, sink):
        self.kernel, self.sink = kernel, sink

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.sink.append((self.kernel, grid, args, kwargs))
        return launch


def _signature(kernel, args, kwargs):
    names = kernel.arg_names
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    values = dict(zip(names, args))
    values.update({k: v for k, v in kwargs.items() if k not in options})
    sig, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        v = values[p.name]
        # as the JIT specialises: 16-byte aligned pointers, ints divisible by 16
        if isinstance(v, torch.Tensor) or (type(v) is int and v % 16 == 0 and not p.is_constexpr):
            attrs[(i,)] = [["tt.divisibility", 16]]
        if p.is_constexpr:
            sig[p.name] = "constexpr"
            constexprs[p.name] = v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + _TYPES[v.dtype]
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i32" if -2**31 <= v < 2**31 else "i64"
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        else:
            raise TypeError(f"{p.name}: cannot type {v!r}")
    return sig, constexprs, attrs, options


def _ptxas_stats(ptx: str, arch: int) -> dict:
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(arch).path
    suffix = "a" if arch >= 90 else ""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        res = subprocess.run([ptxas, f"-arch=sm_{arch}{suffix}", "-v", path, "-o",
                              os.path.join(d, "k.cubin")], capture_output=True, text=True)
    text = res.stdout + res.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill_st = re.search(r"(\d+) bytes spill stores", text)
    spill_ld = re.search(r"(\d+) bytes spill loads", text)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_bytes": (int(spill_st.group(1)) if spill_st else 0)
            + (int(spill_ld.group(1)) if spill_ld else 0)}


def launches(cases=None) -> list:
    """Record the kernel launches of representative calls (CPU tensors, nothing runs)."""
    from labkit.kernels import triton_impl as ti

    if ti.interpreted():
        raise RuntimeError("labkit.kernels.aot needs Triton's compiled mode: "
                           "unset TRITON_INTERPRET")
    sink: list = []
    names = [n for n in dir(ti) if n.endswith("_kernel")]
    saved = {n: getattr(ti, n) for n in names}
    try:
        for n in names:
            setattr(ti, n, _Recorder(saved[n], sink))
        for fn in (cases or default_cases()):
            fn(ti)
    finally:
        for n, k in saved.items():
            setattr(ti, n, k)
    return sink


def default_cases(dtypes=("bf16", "fp16", "fp32")) -> list:
    """Production-like shapes per dtype: GQA decode (D 64/128, groups 1/4/8/32), MLA
    decode (16 and 128 heads, Q 1 and 4), merge, caches, prefill (with and without a
    sliding window), sparse; plus edge
    shapes (tiny head dims of the tiny-* models, a latent without rope dims, merges of 1,
    3 and 256 partials)."""
    i32 = torch.int32
    cases = []
    for name in dtypes:
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]

        def gqa(ti, dt=dt):
            for hq, hkv, d in ((8, 1, 128), (32, 8, 128), (8, 8, 64), (32, 1, 64), (4, 2, 16)):
                ti.paged_decode_attention(
                    torch.empty(2, hq, d, dtype=dt), torch.empty(4, 16, hkv, d, dtype=dt),
                    torch.empty(4, 16, hkv, d, dtype=dt), torch.empty(2, 4, dtype=i32),
                    torch.empty(2, dtype=i32), 0.1, num_splits=2)

        def mla(ti, dt=dt):
            for h, qn, dl, dr in ((16, 1, 512, 64), (128, 1, 512, 64), (16, 4, 512, 64),
                                  (4, 1, 32, 0), (4, 2, 48, 16), (4, 1, 32, 8)):
                ti.mla_paged_decode(
                    torch.empty(2, qn, h, dl + dr, dtype=dt),
                    torch.empty(4, 64, dl + dr, dtype=dt), torch.empty(2, 4, dtype=i32),
                    torch.empty(2, dtype=i32), 0.1, dl, num_splits=2)

        def rest(ti, dt=dt):
            for n in (1, 3, 8, 256):
                ti.merge_attn_states(torch.empty(n, 2, 4, 128, dtype=dt), torch.empty(n, 2, 4))
            ti.reshape_and_cache(torch.empty(3, 8, 128, dtype=dt), torch.empty(3, 8, 128, dtype=dt),
                                 torch.empty(4, 16, 8, 128, dtype=dt),
                                 torch.empty(4, 16, 8, 128, dtype=dt),
                                 torch.empty(3, dtype=torch.int64))
            ti.reshape_and_cache(torch.empty(3, 1, 576, dtype=dt), None,
                                 torch.empty(4, 16, 1, 576, dtype=dt), None,
                                 torch.empty(3, dtype=torch.int64))
            for (hq, hkv, d), window in itertools.product(
                    ((32, 8, 128), (4, 4, 64), (4, 2, 16)), (0, 128)):
                ti.paged_prefill_attention(
                    torch.empty(5, hq, d, dtype=dt), torch.empty(5, hkv, d, dtype=dt),
                    torch.empty(5, hkv, d, dtype=dt), torch.empty(4, 16, hkv, d, dtype=dt),
                    torch.empty(4, 16, hkv, d, dtype=dt), torch.empty(2, 4, dtype=i32),
                    torch.empty(2, dtype=i32), torch.empty(3, dtype=i32), 0.1, window=window)
            for h, dl, dr in ((16, 512, 64), (128, 512, 64), (4, 32, 0), (4, 32, 8)):
                ti.sparse_topk_attention(
                    torch.empty(3, h, dl + dr, dtype=dt), torch.empty(4, 64, dl + dr, dtype=dt),
                    torch.empty(3, 2048, dtype=i32), torch.empty(2, 4, dtype=i32),
                    torch.empty(3, dtype=i32), 0.1, dl)
        cases += [gqa, mla, rest]
    return cases


def representative_cases() -> list:
    """One bf16 launch per kernel at production shapes (a quick compile check)."""
    i32, bf = torch.int32, torch.bfloat16

    def case(ti):
        ti.paged_decode_attention(
            torch.empty(2, 8, 128, dtype=bf), torch.empty(4, 16, 1, 128, dtype=bf),
            torch.empty(4, 16, 1, 128, dtype=bf), torch.empty(2, 4, dtype=i32),
            torch.empty(2, dtype=i32), 0.1, num_splits=2)  # + the merge of the splits
        ti.mla_paged_decode(
            torch.empty(2, 1, 16, 576, dtype=bf), torch.empty(4, 64, 576, dtype=bf),
            torch.empty(2, 4, dtype=i32), torch.empty(2, dtype=i32), 0.1, 512, num_splits=1)
        ti.reshape_and_cache(torch.empty(3, 8, 128, dtype=bf), torch.empty(3, 8, 128, dtype=bf),
                             torch.empty(4, 16, 8, 128, dtype=bf),
                             torch.empty(4, 16, 8, 128, dtype=bf),
                             torch.empty(3, dtype=torch.int64))
        for window in (0, 128):  # the sliding-window variant is its own compilation
            ti.paged_prefill_attention(
                torch.empty(5, 32, 128, dtype=bf), torch.empty(5, 8, 128, dtype=bf),
                torch.empty(5, 8, 128, dtype=bf), torch.empty(4, 16, 8, 128, dtype=bf),
                torch.empty(4, 16, 8, 128, dtype=bf), torch.empty(2, 4, dtype=i32),
                torch.empty(2, dtype=i32), torch.empty(3, dtype=i32), 0.1, window=window)
        ti.sparse_topk_attention(
            torch.empty(3, 16, 576, dtype=bf), torch.empty(4, 64, 576, dtype=bf),
            torch.empty(3, 2048, dtype=i32), torch.empty(2, 4, dtype=i32),
            torch.empty(3, dtype=i32), 0.1, 512)
    return [case]


def compile_all(arch: int = 90, cases=None, ptxas_stats: bool = True) -> list[dict]:
    """Compile every recorded launch for sm_<arch>; one dict per distinct compilation."""
    import triton
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", arch, 32)
    seen, rows = set(), []
    for kernel, _grid, args, kwargs in launches(cases):
        sig, constexprs, attrs, options = _signature(kernel, args, kwargs)
        key = (kernel.fn.__name__, tuple(sorted(sig.items())),
               tuple(sorted((k, str(v)) for k, v in constexprs.items())),
               tuple(sorted(options.items())))
        if key in seen:
            continue
        seen.add(key)
        src = triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs=constexprs,
                                        attrs=attrs)
        compiled = triton.compile(src, target=target, options=options)
        row = {"kernel": kernel.fn.__name__,
               "dtype": next((v[1:] for v in sig.values() if v.startswith("*f")
                              or v.startswith("*b")), ""),
               "constexprs": {k: v for k, v in constexprs.items() if k.isupper()},
               **options, "shared_bytes": compiled.metadata.shared}
        if ptxas_stats:
            row.update(_ptxas_stats(compiled.asm["ptx"], arch))
        rows.append(row)
    return rows


if __name__ == "__main__":
    import sys

    arch = int(sys.argv[1]) if len(sys.argv) > 1 else 90
    for r in compile_all(arch):
        print(r)
