"""Experiments: parameterised notebooks run in batch with papermill, and sweeps.

    from labkit.experiments import run_sweep
    results = run_sweep("notebooks/experiments/agentx_replay.ipynb",
                        {"layout": ["tp1", "tp2"], "concurrency": [2, 8]},
                        out="runs/grid", jobs=2)

`labkit sweep NOTEBOOK -p NAME V1,V2 ... --out DIR` is the same from the shell
(`labkit.experiments.cli`). The notebooks live in ``notebooks/experiments/``:
`agentx_replay.ipynb` (one replay, writes requests.parquet, steps.parquet,
summary.json) and `compare.ipynb` (the throughput/GPU vs interactivity frontier of a
sweep). See `labkit.experiments.sweep` for run names and the results.parquet schema,
`executors` for where points run (local processes or Ray tasks), `resume` for
``--resume``, and `plan` for the deployment planner (`labkit plan`).
"""

from __future__ import annotations

from pathlib import Path

from labkit.experiments.frontier import X_METRIC, Y_METRIC, load_results, load_run, pareto_mask
from labkit.experiments.sweep import (
    SweepInputError, SweepPlan, notebook_parameters, parse_parameter_args, parse_value,
    parse_values, plan_sweep, run_sweep, swept_parameters,
)

__all__ = [
    "SweepInputError", "SweepPlan", "X_METRIC", "Y_METRIC", "experiment_notebook",
    "load_results", "load_run", "notebook_parameters", "pareto_mask", "parse_parameter_args",
    "parse_value", "parse_values", "plan_sweep", "run_sweep", "swept_parameters",
]


def experiment_notebook(name: str) -> Path:
    """Path of a notebook in notebooks/experiments/: found next to the current
    directory (as Jupyter runs a notebook), under it, or beside the labkit sources."""
    here = Path.cwd()
    candidates = [here / name, here / "notebooks" / "experiments" / name,
                  Path(__file__).resolve().parents[2] / "notebooks" / "experiments" / name]
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(f"experiment notebook {name!r} not found (looked in "
                            + ", ".join(str(p.parent) for p in candidates) + ")")
