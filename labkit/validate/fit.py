"""Fit the step overheads on the fitted part of the measured runs, and print them.

    python -m labkit.validate.fit [DATA_DIR]     # default: ../shared/data

Only runs whose `part` is "fitted" (BLIS's default_args campaign, `runs.py`) are
replayed; the held-out runs never enter. What the data can tell apart, and so what is
fitted — two constants, in order, each by a deterministic one-dimensional search:

1. `step_gap_s`, the per-step GPU idle that async scheduling does not hide: every run
   here is GPU-bound under async scheduling and CUDA graphs, so TPOT is the decode
   kernels plus that gap. A secant search (from 0 and 1 ms, at most `MAX_ITER` steps)
   zeroes the median over runs of log(simulated TPOT / measured TPOT).
2. `FRONTEND_S`, the OpenAI server's per-request share of TTFT and E2E
   (`simulate.py`): the median over runs of measured minus simulated TTFT mean, with
   the gap of step 1.

The CPU's own costs (`cpu_*`), the launch costs of PIECEWISE and eager steps and the DP
all-reduce are not fitted: under async scheduling and GPU-bound steps these runs hide
them (the GPU never waits for the CPU), so they keep the documented values in
`overheads.py`. Replays run at `FIT_SCALE` of the measured durations.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np

from labkit.engine.sim.overheads import FITTED, OverheadParams
from labkit.validate.runs import load_runs
from labkit.validate.simulate import simulate_run

FIT_SCALE = 0.1
MAX_ITER = 4
TOLERANCE = 0.002  # |median log ratio| at which the gap search stops


def fitted_runs(runs):
    """The runs a fit may see: fitted part, replayable."""
    return runs[(runs["part"] == "fitted") & runs["skip"].isna()]


def fit(data_dir, duration_scale: float = FIT_SCALE, verbose: bool = False) -> dict:
    """{"step_gap_s", "frontend_s", "evaluations": [(gap, bias), ...]} from the fitted runs."""
    runs = [run for _, run in fitted_runs(load_runs(data_dir)).iterrows()]
    seen: dict[float, tuple[float, list]] = {}

    def bias(gap: float) -> float:
        params = dataclasses.replace(FITTED, step_gap_s=float(gap))
        sims = [simulate_run(run, duration_scale, params, frontend_s=0.0) for run in runs]
        b = float(np.median([np.log(s["tpot"] / run["tpot"]) for s, run in zip(sims, runs)]))
        seen[float(gap)] = (b, sims)
        if verbose:
            print(f"  step_gap_s={gap * 1e3:.3f} ms: median log(TPOT sim/measured) {b:+.4f}",
                  file=sys.stderr)
        return b

    g0, g1 = 0.0, 1.0e-3
    f0, f1 = bias(g0), bias(g1)
    for _ in range(MAX_ITER):
        if abs(f1) < TOLERANCE or f1 == f0:
            break
        g0, f0, g1 = g1, f1, max(0.0, g1 - f1 * (g1 - g0) / (f1 - f0))
        f1 = bias(g1)
    best = min(seen, key=lambda g: abs(seen[g][0]))
    sims = seen[best][1]
    frontend = max(0.0, float(np.median([run["ttft_mean"] - s["ttft_mean"]
                                         for s, run in zip(sims, runs)])))
    return {"step_gap_s": best, "frontend_s": frontend,
            "evaluations": [(g, seen[g][0]) for g in seen], "runs": [r["id"] for r in runs]}


def format_constants(fitted: dict, base: OverheadParams = FITTED) -> str:
    params = dataclasses.replace(base, step_gap_s=fitted["step_gap_s"])
    fields = ", ".join(f"{f.name}={getattr(params, f.name):.4g}"
                       for f in dataclasses.fields(params))
    return (f"# labkit/engine/sim/overheads.py\nFITTED = OverheadParams({fields})\n"
            f"# labkit/validate/simulate.py\nFRONTEND_S = {fitted['frontend_s']:.4g}")


def main(argv: list[str] | None = None) -> int:
    from labkit.bench import shared_data_dir

    argv = sys.argv[1:] if argv is None else argv
    data_dir = argv[0] if argv else shared_data_dir()
    if data_dir is None:
        print("no measured runs: pass DATA_DIR or put ../shared/data next to the repo",
              file=sys.stderr)
        return 2
    fitted = fit(data_dir, verbose=True)
    print(format_constants(fitted))
    print(f"# fitted on {len(fitted['runs'])} runs at duration_scale={FIT_SCALE}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
