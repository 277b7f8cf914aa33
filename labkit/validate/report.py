"""`validate`: replay every measured run and compare, per run and as median APE.

Each replayable run (`runs.load_runs`) is simulated (`simulate.simulate_run`) and its
metrics compared with the measured ones as absolute percentage error,
|simulated / measured - 1| · 100. The medians over runs are reported separately for the
*fitted* part (the runs the step-overhead constants were fitted on) and the
*held-out* part (never seen by any fit): the held-out numbers are the honest ones.

    result = validate("../shared/data")
    result.experiments      # one row per run: measured_*, simulated_*, ape_* columns
    result.median_ape       # {metric: median APE %} over the fitted runs
    result.median_ape_holdout
    result.bias()           # mean signed error % per model and layout: which way it is off
    result.stages           # one row per run and load stage: measured_*, simulated_*
    result.stage_bias()     # the signed error per model and stage, two-stage runs: how it
                            # moves with the load
    result.to_json()        # {"experiments": [...], "median_ape": ..., "median_ape_holdout": ...}

APE says how far off a run is; the signed error, averaged over a model's runs, says which
way -- a constant sign per model is the cost model's error for that model's shapes, not
noise (the held-out large-vocabulary models' negative TPOT bias is how the sampler's cost
was found, NOTES.md session 36) -- unless the measured runs carry a startup tail that moves
their mean alone (`tail_runs`; then read the TTFT p90 column).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from labkit.validate.runs import METRICS, load_runs
from labkit.validate.simulate import simulate_run

DEFAULT_SCALE = 0.1  # replayed seconds per measured second (see workload.py)
GOAL_APE = 15.0  # the goal on the held-out part: E2E mean, TTFT mean, TPOT
GOAL_METRICS = ("e2e_mean", "ttft_mean", "tpot")
# the signed error's columns: the goal's, and the TTFT p90, which a startup tail in the
# measured run (`runs.py`) leaves alone where it moves the mean
BIAS_METRICS = ("e2e_mean", "ttft_mean", "ttft_p90", "tpot")
# what both files publish per load stage (`ValidationResult.stages`)
STAGE_METRICS = ("ttft_mean", "ttft_p90", "e2e_mean", "e2e_p90", "tpot")


@dataclass
class ValidationResult:
    experiments: pd.DataFrame
    skipped: pd.DataFrame
    duration_scale: float
    wall_s: float = 0.0
    stages: pd.DataFrame = field(default_factory=pd.DataFrame)
    median_ape: dict = field(init=False)
    median_ape_holdout: dict = field(init=False)

    def __post_init__(self) -> None:
        self.median_ape = median_ape(self.experiments, "fitted")
        self.median_ape_holdout = median_ape(self.experiments, "held_out")

    def to_json(self) -> dict:
        """JSON-ready: NaN (a metric a run was not measured on) becomes null."""
        return _clean({
            "experiments": self.experiments.to_dict(orient="records"),
            "median_ape": self.median_ape,
            "median_ape_holdout": self.median_ape_holdout,
            "goal": {"metrics": list(GOAL_METRICS), "median_ape_below": GOAL_APE,
                     "met_on_holdout": all(self.median_ape_holdout.get(m, math.inf) <= GOAL_APE
                                           for m in GOAL_METRICS)},
            "bias": self.bias().reset_index().to_dict(orient="records"),
            "stages": self.stages.to_dict(orient="records"),
            "stage_bias": self.stage_bias().reset_index().to_dict(orient="records"),
            "skipped": self.skipped.to_dict(orient="records"),
            "settings": {"duration_scale": self.duration_scale, "wall_s": self.wall_s},
        })

    def table(self) -> pd.DataFrame:
        """Median APE per metric (rows), fitted and held-out (columns), in percent."""
        return pd.DataFrame({"fitted": self.median_ape, "held_out": self.median_ape_holdout})

    def bias(self) -> pd.DataFrame:
        return signed_bias(self.experiments)

    def stage_bias(self) -> pd.DataFrame:
        return stage_bias(self.stages)


def signed_bias(experiments: pd.DataFrame, metrics=BIAS_METRICS,
                by=("model", "layout")) -> pd.DataFrame:
    """Per model and layout (`by`): the mean over its runs of (simulated / measured - 1)
    x 100 for each metric (below 0: the simulator is faster than the measured runs), the
    parts its runs belong to, how many there are and how many of them carry a startup
    tail (`tail_runs`: a stage's measured TTFT mean above its p90, `runs.py`).
    `experiments`: `ValidationResult.experiments` or the stored JSON's "experiments" as a
    DataFrame (or its stage rows: `stage_bias`)."""
    signed = experiments.assign(**{m: (experiments[f"simulated_{m}"]
                                       / experiments[f"measured_{m}"] - 1.0) * 100.0
                                   for m in metrics})
    groups = signed.groupby(list(by))
    out = groups[list(metrics)].mean()
    out.insert(0, "tail_runs", groups["measured_ttft_tail"].sum().astype(int))
    out.insert(0, "runs", groups.size())
    out.insert(0, "part", groups["part"].agg(lambda p: "/".join(sorted(set(p)))))
    return out


def stage_bias(stages: pd.DataFrame) -> pd.DataFrame:
    """The signed error per model, layout and load stage, over the runs of more than one
    stage (the stages of one run are one deployment at rising loads: an error that grows
    from stage 0 to stage 1 grows with the batch). `stages`: `ValidationResult.stages` or
    the stored JSON's "stages" as a DataFrame."""
    if stages.empty:
        return pd.DataFrame()
    several = stages[stages.groupby("id")["stage"].transform("size") > 1]
    out = signed_bias(several, ("ttft_mean", "ttft_p90", "tpot"),
                      by=("model", "layout", "stage"))
    out.insert(2, "rate", several.groupby(["model", "layout", "stage"])["rate"].mean())
    return out


def median_ape(experiments: pd.DataFrame, part: str) -> dict:
    rows = experiments[experiments["part"] == part]
    out = {}
    for m in METRICS:
        values = rows[f"ape_{m}"].dropna() if len(rows) else pd.Series(dtype=float)
        out[m] = float(values.median()) if len(values) else float("nan")
    out["runs"] = int(len(rows))
    return out


def validate(data_dir, duration_scale: float = DEFAULT_SCALE, run_ids=None,
             progress: bool = True) -> ValidationResult:
    """Replay the replayable runs of `data_dir` (all, or those in `run_ids`)."""
    runs = load_runs(data_dir)
    skipped = runs[runs["skip"].notna()][["id", "source", "hf_model", "workload", "skip"]]
    todo = runs[runs["skip"].isna()]
    if run_ids is not None:
        unknown = sorted(set(run_ids) - set(todo["id"]))
        if unknown:
            raise KeyError(f"no replayable measured run {unknown[0]!r}; replayable: "
                           f"{', '.join(todo['id'])}")
        todo = todo[todo["id"].isin(run_ids)]
    start = time.perf_counter()
    rows, stage_rows = [], []
    for _, run in tqdm(list(todo.iterrows()), desc="validate", disable=not progress):
        simulated = simulate_run(run, duration_scale)
        rows.append(_compare(run, simulated))
        stage_rows += _compare_stages(run, simulated)
    return ValidationResult(pd.DataFrame(rows), skipped.reset_index(drop=True),
                            duration_scale, time.perf_counter() - start,
                            pd.DataFrame(stage_rows))


def _compare(run, simulated: dict) -> dict:
    row = {k: run[k] for k in ("id", "source", "part", "model", "hardware", "layout",
                               "workload")}
    for m in METRICS:
        measured, sim = float(run[m]), float(simulated[m])
        row[f"measured_{m}"] = measured
        row[f"simulated_{m}"] = sim
        row[f"ape_{m}"] = abs(sim / measured - 1.0) * 100.0 if measured > 0 else float("nan")
    row["measured_ttft_tail"] = bool(run["ttft_tail"])
    row["requests"] = simulated["requests"]
    return row


def _compare_stages(run, simulated: dict) -> list[dict]:
    """One row per load stage the run's file measured: its rate, the measured and
    simulated metrics (the startup-tail flag of the stage itself)."""
    rows = []
    for k, (measured, sim) in enumerate(zip(run["stage_measured"], simulated["stages"])):
        row = {key: run[key] for key in ("id", "part", "model", "layout", "workload")}
        row.update(stage=k, rate=float(run["stages"][k][0]), requests=sim["requests"],
                   measured_ttft_tail=bool(measured["ttft_mean"] > measured["ttft_p90"]))
        for m in STAGE_METRICS:
            row[f"measured_{m}"], row[f"simulated_{m}"] = float(measured[m]), float(sim[m])
        rows.append(row)
    return rows


def _clean(value):
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, (np.floating, float)):
        return None if math.isnan(float(value)) else float(value)
    if isinstance(value, np.integer):
        return int(value)
    return value
