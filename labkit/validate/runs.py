"""The measured serving runs `labkit validate` replays, read from ../shared/data/e2e.

The folder (`blis_h100_vllm`, see its README) holds client-side aggregates of real vLLM
v0.15.1 runs: `default_args_stage_metrics.csv` (BLIS's training campaign: 16 runs on
H100) and `s2r_measured_aggregates.csv` (the measured side of its sim-to-real study).
`load_runs` turns both into one table, one row per run, with what a replay needs — the
model preset, layout, GPU, vLLM knobs, the workload's stages and lengths — and the
measured whole-run metrics, or the reason the run cannot be replayed:

- **not specified**: the "lite" workloads' rates and lengths were never published;
- **duplicate**: s2r rows that repeat a default_args run (or, per the CSV's own note,
  mislabel one) — the default_args row is kept;
- **overloaded**: TTFT mean above `OVERLOAD_TTFT_S`; the client timed requests out and
  reports only the survivors (the default_args `reasoning` runs);
- **no preset**: a model labkit has no preset for (Llama-4-Scout, Yi-34B).

**The split** is deterministic and follows the data's provenance: every default_args
run is *fitted* (the step-overhead constants are fitted on them only,
`labkit.validate.fit`); every s2r run is *held out* (other models — Qwen3-14B,
Llama-3.1, Mixtral-8x22B, Mistral-Nemo, Qwen2.5 — and other knobs: TP, token budget,
memory utilisation).

**Metrics**, seconds: TTFT and E2E mean / p90 as the client measured them; TPOT as
(E2E mean - TTFT mean) / (output tokens - 1) with the workload's nominal output length
(the requests ran with `ignore_eos`; the client's own token counts are unreliable, the
README's `derived_tpot_nominal_ms`); throughput in tokens/s, prompt plus nominal output
tokens per second (default_args only: s2r publishes no rates). The same per load stage
too (`stage_measured`, one dict per stage in the order they ran; empty where a file has no
stage rows): a two-stage run's stages are one deployment at two loads, so they show how
the simulator's error moves with the batch.

**A startup tail** (`ttft_tail`): in some runs a load stage's TTFT *mean* lies above
its own p90 -- a few requests took ten times the p90 (the Mixtral runs' first stage in
the two-stage workloads: p99 0.18-0.9 s against a p90 near 60 ms), as a server does
while it compiles kernels for shapes it meets for the first time. No steady-state
simulation has such a tail, so on those runs the TTFT mean error says little about the
simulator, while the p90 still does; the flag marks them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

DATA_SUBDIR = Path("e2e") / "blis_h100_vllm"
OVERLOAD_TTFT_S = 10.0
METRICS = ("ttft_mean", "ttft_p90", "e2e_mean", "e2e_p90", "tpot", "throughput")

# The workloads of the README's table: system prompt, question, output, stages.
WORKLOADS = {
    "general": dict(system_len=100, question_len=447, output_len=248,
                    stages=((8.0, 600.0), (20.0, 600.0))),
    "codegen": dict(system_len=100, question_len=466, output_len=247,
                    stages=((5.0, 600.0), (10.0, 600.0))),
    "roleplay": dict(system_len=150, question_len=600, output_len=251,
                     stages=((6.0, 1200.0),)),
    "reasoning": dict(system_len=100, question_len=934, output_len=1448,
                      stages=((4.0, 1200.0),)),
}
GROUPS, PROMPTS_PER_GROUP = 10, 10  # 10 system prompts, each shared by 10 questions

MODELS = {
    "meta-llama/Llama-2-7b-hf": "llama-2-7b",
    "meta-llama/Llama-2-70b-hf": "llama-2-70b",
    "codellama/CodeLlama-34b-Instruct-hf": "codellama-34b",
    "mistralai/Mixtral-8x7B-v0.1": "mixtral-8x7b",
    "mistralai/Mixtral-8x22B-Instruct-v0.1": "mixtral-8x22b",
    "mistralai/Mixtral-8x22B-v0.1": "mixtral-8x22b",
    "Qwen/Qwen3-14B": "qwen3-14b",
    "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b",
    "meta-llama/Llama-3.1-70B-Instruct": "llama-3.1-70b",
    "mistralai/Mistral-Nemo-Instruct-2407": "mistral-nemo-12b",
    "Qwen/Qwen2.5-7B-Instruct": "qwen2.5-7b",
}
HARDWARE = {"H100": "h100", "A100-80GB": "a100-80gb", "L40S": "l40s"}


def data_folder(data_dir: str | Path) -> Path:
    """Accept the shared data root, its e2e folder, or the run folder itself."""
    root = Path(data_dir)
    for candidate in (root / DATA_SUBDIR, root / DATA_SUBDIR.name, root):
        if (candidate / "default_args_stage_metrics.csv").is_file():
            return candidate
    raise FileNotFoundError(f"no measured runs (default_args_stage_metrics.csv) under {root}")


def load_runs(data_dir: str | Path) -> pd.DataFrame:
    """Every measured run, one row each: `part` (fitted / held_out), `skip` (None or
    why it is not replayed), the replay's settings and the measured metrics."""
    folder = data_folder(data_dir)
    default = _default_args(pd.read_csv(folder / "default_args_stage_metrics.csv"))
    offsets = _prompt_offsets(default)
    s2r = _s2r(pd.read_csv(folder / "s2r_measured_aggregates.csv"), offsets)
    runs = pd.concat([default, s2r], ignore_index=True)
    overloaded = runs["skip"].isna() & (runs["ttft_mean"] > OVERLOAD_TTFT_S)
    runs.loc[overloaded, "skip"] = "overloaded (TTFT mean > 10 s: survivors only)"
    return runs


def _row(run_id, source, part, model_name, hardware, tp, knobs, workload, prompt_len,
         measured, skip=None) -> dict:
    spec = WORKLOADS.get(workload, {})
    preset = MODELS.get(model_name)
    if skip is None and preset is None:
        skip = f"no preset for {model_name}"
    return {"id": run_id, "source": source, "part": part, "model": preset,
            "hf_model": model_name, "hardware": hardware, "layout": f"tp{int(tp)}",
            "workload": workload, "knobs": knobs, "prompt_len": prompt_len,
            "output_len": spec.get("output_len"), "stages": spec.get("stages"),
            "system_len": spec.get("system_len"), "skip": skip, **measured}


def _default_args(frame: pd.DataFrame) -> pd.DataFrame:
    rows = []
    stage_rows = _stage_rows(frame[frame["stage"] != "summary"], "experiment",
                             frame["stage"].str.removeprefix("stage_"))
    for _, r in frame[frame["stage"] == "summary"].iterrows():
        workload = next(w for w in WORKLOADS if r["experiment"].endswith(w))
        spec = WORKLOADS[workload]
        stages = tuple(tuple(map(float, s)) for s in json.loads(r["load_stages"]))
        assert stages == spec["stages"], (r["experiment"], stages)
        out = spec["output_len"]
        measured = _measured(r["ttft_mean_ms"], r["ttft_p90_ms"], r["e2e_mean_ms"],
                             r["e2e_p90_ms"], out)
        measured.update(_per_stage(stage_rows.get(r["experiment"], []), "ttft_mean_ms",
                                   "ttft_p90_ms", "e2e_mean_ms", "e2e_p90_ms", out))
        # tokens per second the client sent and received, nominal output lengths
        measured["throughput"] = float(r["input_tokens_per_sec"]
                                       + r["requests_per_sec"] * out)
        knobs = dict(max_num_batched_tokens=int(r["max_num_batched_tokens"]),
                     max_num_seqs=int(r["max_num_seqs"]), max_model_len=int(r["max_model_len"]),
                     gpu_memory_utilization=0.9)
        rows.append(_row(r["experiment"], "default_args", "fitted", r["model"], "h100",
                         r["tp"], knobs, workload, float(r["prompt_len_mean"]), measured))
    return pd.DataFrame(rows)


def _prompt_offsets(default: pd.DataFrame) -> dict:
    """Tokens the measured prompts carry beyond system + question, per workload (the
    tokenizer re-reading random text, special tokens): the mean over default_args."""
    nominal = default["workload"].map(lambda w: WORKLOADS[w]["system_len"]
                                      + WORKLOADS[w]["question_len"])
    return (default["prompt_len"] - nominal).groupby(default["workload"]).mean().to_dict()


def _s2r(frame: pd.DataFrame, offsets: dict) -> pd.DataFrame:
    rows = []
    stage_rows = _stage_rows(frame[frame["stage_index"] >= 0], "folder", frame["stage_index"])
    for _, r in frame[frame["stage_index"] == -1].iterrows():
        workload = str(r["workload"])
        skip = None
        if "lite" in workload or "lite" in str(r["folder"]):
            skip = "workload not specified publicly (lite)"
        elif isinstance(r["default_args_match"], str):
            skip = "duplicate of a default_args run"
        spec = WORKLOADS.get(workload.replace("-lite", ""))
        out = spec["output_len"] if spec else np.nan
        measured = _measured(r["ttft_mean"], r["ttft_p90"], r["e2e_mean"], r["e2e_p90"], out)
        measured["throughput"] = np.nan
        measured.update(_per_stage(stage_rows.get(r["folder"], []), "ttft_mean", "ttft_p90",
                                   "e2e_mean", "e2e_p90", out))
        util = r["gpu_mem_util"] if pd.notna(r["gpu_mem_util"]) else 0.9
        knobs = dict(max_num_batched_tokens=int(r["max_num_batched_tokens"]), max_num_seqs=128,
                     max_model_len=4096, gpu_memory_utilization=float(util))
        prompt = (spec["system_len"] + spec["question_len"] + offsets.get(workload, 0.0)
                  if spec else np.nan)
        rows.append(_row(str(r["folder"]), "s2r", "held_out", r["model"],
                         HARDWARE.get(str(r["hardware"]), str(r["hardware"])), r["tp"], knobs,
                         workload, prompt, measured, skip))
    return pd.DataFrame(rows)


def _stage_rows(stages: pd.DataFrame, run: str, index: pd.Series) -> dict:
    """{run: its load stages' rows, in the order they ran} (a stage listed twice, as
    some train/val rows are, once)."""
    order = stages.assign(_k=index.loc[stages.index].astype(int)).sort_values("_k") \
        .drop_duplicates([run, "_k"])
    return {key: [row for _, row in rows.iterrows()] for key, rows in order.groupby(run)}


def _per_stage(rows: list, ttft_mean: str, ttft_p90: str, e2e_mean: str, e2e_p90: str,
               output_len) -> dict:
    """A run's `stage_measured` (each load stage's metrics, as the run's own) and
    `ttft_tail` (a stage whose TTFT mean lies above its p90: the module docstring)."""
    stages = tuple(_measured(r[ttft_mean], r[ttft_p90], r[e2e_mean], r[e2e_p90], output_len)
                   for r in rows)
    return {"stage_measured": stages,
            "ttft_tail": any(st["ttft_mean"] > st["ttft_p90"] for st in stages)}


def _measured(ttft_mean, ttft_p90, e2e_mean, e2e_p90, output_len) -> dict:
    ms = 1e-3
    return {"ttft_mean": ttft_mean * ms, "ttft_p90": ttft_p90 * ms,
            "e2e_mean": e2e_mean * ms, "e2e_p90": e2e_p90 * ms,
            "tpot": (e2e_mean - ttft_mean) * ms / (output_len - 1)}
