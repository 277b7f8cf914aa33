"""`make gpu-check`: what a CUDA machine can tell us that this CPU box cannot.

One script, meant to finish in under 8 minutes on one H200:

1. the kernel and compute tests with CUDA present (the Triton kernels compiled, not
   interpreted);
2. `labkit bench kernels --quick`: each kernel's time against the HBM roofline;
3. a llama-3.1-8b-sized compute-plane replay (seeded random weights, bf16, measured
   clock) beside the simulated replay of the same trace: output tokens per second
   measured on the GPU, and as the cost model predicts them.

Without CUDA it says so and exits 0 (so `make gpu-check` is harmless anywhere). Record
the figures it prints in NOTES.md.
"""

from __future__ import annotations

import subprocess
import sys
import time

TESTS_TIMEOUT_S = 240
REPLAY_SESSIONS = 4


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("labkit gpu-check: torch sees no CUDA GPU here; nothing to check.")
        return 0
    failed = []
    print(f"labkit gpu-check on {torch.cuda.get_device_name(0)}")
    start = time.perf_counter()
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "tests/kernels",
                            "tests/compute/test_runner_behaviour.py", "-m", "not slow"],
                           timeout=TESTS_TIMEOUT_S)
    print(f"[1] CUDA tests: exit {tests.returncode} ({time.perf_counter() - start:.0f} s)")
    if tests.returncode:
        failed.append("tests")
    from labkit.kernels.bench import bench_kernels

    print("[2] kernels against the HBM roofline")
    bench_kernels(quick=True)
    print("[3] llama-3.1-8b-sized replay, random weights, bf16")
    measured, predicted = replay_rate("compute"), replay_rate("sim")
    print(f"    output tokens/s: measured {measured:,.0f}, cost model {predicted:,.0f} "
          f"(measured / predicted {measured / predicted:.2f})")
    print(f"labkit gpu-check: done in {time.perf_counter() - start:.0f} s"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def replay_rate(backend: str) -> float:
    """Output tokens per simulated second (measured step times on the compute plane)."""
    from labkit import Engine
    from labkit.traces import TINY_AGENTX, generate_agentx_trace

    trace = generate_agentx_trace(REPLAY_SESSIONS, seed=1, block_size=16, **TINY_AGENTX)
    opts = dict(device="cuda", dtype="bfloat16", clock="measured") \
        if backend == "compute" else {}
    engine = Engine(model="llama-3.1-8b", layout="tp1", backend=backend,
                    num_gpu_blocks_override=4096, **opts)
    result = engine.replay(trace, concurrency=REPLAY_SESSIONS, loop_trace=False,
                           max_idle_s=1.0, start_part_way=False)
    if backend == "compute":
        engine.data_plane.close()
    return float(result.requests.output_tokens.sum() / result.summary["sim_duration_s"])


if __name__ == "__main__":
    raise SystemExit(main())
