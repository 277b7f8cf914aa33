"""Comparing runs: the AgentX throughput-per-GPU vs interactivity frontier.

Each run is a point (x = interactivity, P90 tokens/s/user; y = throughput, tokens/s/GPU);
both are better when larger. A run is on the Pareto frontier when no other run is at
least as good on both and better on one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pandas as pd

X_METRIC = "interactivity_p90_tok_s"
Y_METRIC = "throughput_tok_s_per_gpu"


def pareto_mask(x, y) -> np.ndarray:
    """True where (x[i], y[i]) is not dominated (both maximised; NaN never is)."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    ok = ~(np.isnan(x) | np.isnan(y))
    mask = np.zeros(len(x), dtype=bool)
    for i in np.flatnonzero(ok):
        better_eq = ok & (x >= x[i]) & (y >= y[i])
        strictly = better_eq & ((x > x[i]) | (y > y[i]))
        mask[i] = not strictly.any()
    return mask


def load_results(sweep_dir: str | os.PathLike) -> pd.DataFrame:
    """results.parquet of a sweep, with a `pareto` column (ok runs only can be True)."""
    frame = pd.read_parquet(Path(sweep_dir) / "results.parquet")
    ok = frame["status"] == "ok"
    x = frame[X_METRIC] if X_METRIC in frame else pd.Series(np.nan, index=frame.index)
    y = frame[Y_METRIC] if Y_METRIC in frame else pd.Series(np.nan, index=frame.index)
    frame["pareto"] = pareto_mask(x.where(ok), y.where(ok))
    return frame


def load_run(sweep_dir: str | os.PathLike, run: str) -> tuple[pd.DataFrame, dict]:
    """One run's requests table and summary; `measured` marks the calls the summary
    counts (completed, arrived after warm-up, finished inside the simulated window)."""
    run_dir = Path(sweep_dir) / run
    summary = json.loads((run_dir / "summary.json").read_text())
    requests = pd.read_parquet(run_dir / "requests.parquet")
    if len(requests):
        requests["measured"] = (requests["completed"].astype(bool)
                                & (requests["arrival_s"] >= summary.get("warmup_s", 0.0))
                                & (requests["finish_s"] <= summary.get("sim_duration_s", np.inf)))
    else:
        requests["measured"] = pd.Series(dtype=bool)
    return requests, summary
