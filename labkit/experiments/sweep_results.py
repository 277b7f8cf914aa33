"""A sweep's results table: one row per finished run, typed for parquet.

Each row is the point's parameters, the run's outcome (``run``, ``status``, ``error``,
``run_s``) and its ``summary.json`` flattened (nested keys joined with ``.``; a key
that clashes with a column above becomes ``summary.<key>``). Parquet wants one type per
column, so each column is typed from what the runs gave (`_column`). `sweep.py` runs
the points; this module only reads what they left.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

if TYPE_CHECKING:
    from labkit.experiments.sweep import RunOutcome, SweepPlan

RESERVED_COLUMNS = ("run", "status", "error", "run_s")
SUMMARY_FILE = "summary.json"
RESULTS_FILE = "results.parquet"
PLAN_FILE = "sweep.json"


def text(value) -> str:
    """A parameter value as text (floats by repr, so 0.1 stays 0.1)."""
    return value if isinstance(value, str) else repr(value) if isinstance(value, float) \
        else str(value)


def flatten(summary: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in summary.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        elif isinstance(value, (list, tuple)):
            flat[name] = json.dumps(value)
        else:
            flat[name] = value
    return flat


def collect_results(plan: SweepPlan, outcomes: list[RunOutcome | None]) -> pd.DataFrame:
    """One row per finished run (a None outcome: the run did not finish)."""
    taken = set(plan.parameters) | set(RESERVED_COLUMNS)
    rows = []
    for point, outcome in zip(plan.points, outcomes):
        if outcome is None:
            continue
        row = dict(point)
        row.update(run=outcome.name, status=outcome.status, error=outcome.error,
                   run_s=outcome.seconds)
        summary_path = plan.out / outcome.name / SUMMARY_FILE
        if outcome.status == "ok" and summary_path.is_file():
            for key, value in flatten(json.loads(summary_path.read_text())).items():
                row[f"summary.{key}" if key in taken else key] = value
        rows.append(row)
    columns = list(dict.fromkeys(key for row in rows for key in row))
    return pd.DataFrame({c: _column([row.get(c) for row in rows]) for c in columns})


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _column(values: list) -> pd.Series:
    """One type per column, as parquet wants: ints stay ints (nullable where a failed
    run left a hole), ints mixed with floats become floats, other mixtures text."""
    present = [v for v in values if not _missing(v)]
    kinds = {type(v) for v in present}
    holes = len(present) < len(values)
    if not kinds:  # a metric that is NaN in every run is still a number column
        floats = any(isinstance(v, float) for v in values)
        return pd.Series([math.nan if floats else None] * len(values),
                         dtype=float if floats else object)
    if kinds == {bool}:
        return pd.Series(values, dtype="boolean" if holes else bool)
    if kinds == {int}:
        return pd.Series(values, dtype="Int64" if holes else "int64")
    if kinds <= {int, float}:
        return pd.Series([math.nan if _missing(v) else float(v) for v in values], dtype=float)
    if kinds == {str}:
        return pd.Series(values, dtype=object)
    return pd.Series([None if _missing(v) else text(v) for v in values], dtype=object)


def write_parquet_atomic(frame: pd.DataFrame, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    frame.to_parquet(tmp, index=False)
    os.replace(tmp, path)


def load_plan(sweep_dir: str | os.PathLike) -> dict | None:
    path = Path(sweep_dir) / PLAN_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def swept_parameters(results: pd.DataFrame, sweep_dir: str | os.PathLike | None = None) -> list:
    """The parameter columns of a results table (those before ``run``)."""
    plan = load_plan(sweep_dir) if sweep_dir is not None else None
    if plan is not None:
        return [p for p in plan["parameters"] if p in results.columns]
    return list(results.columns[:list(results.columns).index("run")])
