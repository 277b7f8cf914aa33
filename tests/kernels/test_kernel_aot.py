"""The Triton kernels compile for a Hopper GPU (sm_90) without spilling registers.

The interpreter runs the kernels' Python and accepts code the compiler would refuse
(and says nothing about registers), so this compiles every launch the launchers make
for production-like shapes, offline, with Triton's bundled ptxas — in a subprocess,
since the test process may have Triton in interpreter mode.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import json, sys
import labkit.kernels.aot as A
arg = sys.argv[1]
cases = A.representative_cases() if arg == "quick" else A.default_cases(tuple(arg.split(",")))
print(json.dumps(A.compile_all(90, cases=cases), default=str))
"""


def _compile(dtypes: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    res = subprocess.run([sys.executable, "-c", SCRIPT, dtypes], capture_output=True, text=True,
                         env=env, timeout=300)
    if res.returncode and "ptxas" in res.stderr and "not found" in res.stderr.lower():
        pytest.skip("Triton's ptxas is not available")
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _check(rows):
    kernels = {r["kernel"] for r in rows}
    assert kernels == {"_gqa_decode_kernel", "_mla_decode_kernel", "_merge_kernel",
                       "_cache_kernel", "_prefill_kernel", "_sparse_kernel"}
    spilling = [r for r in rows if r["spill_bytes"]]
    assert not spilling, f"register spills: {spilling}"
    for r in rows:  # Hopper: 227 KB of shared memory per block at most
        assert r["shared_bytes"] <= 227 * 1024, r


def test_kernels_compile_for_sm90():
    """One bf16 launch per kernel at production shapes."""
    _check(_compile("quick"))


@pytest.mark.slow
def test_all_dtypes_and_edge_shapes_compile_for_sm90():
    """A 16-bit and a 32-bit dtype; tiny head dims, no rope dims, GQA groups 1-32,
    merges of 1-256. (fp16 is left to `python -m labkit.kernels.aot`: its tiles, and so
    its registers and shared memory, are bf16's, and it would add a minute here.)"""
    _check(_compile("bf16,fp32"))
