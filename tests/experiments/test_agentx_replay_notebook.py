"""agentx_replay.ipynb executed by papermill writes requests.parquet, steps.parquet and
summary.json, and they agree with each other, with the parameters and with the trace."""

from __future__ import annotations

import json

import nbformat
import numpy as np
import pandas as pd
import pytest

from labkit import Layout, write_trace
from support import small_agentx
from sweep_helpers import AGENTX_REPLAY, TRACE_REPLAY


def test_replay_notebook_writes_three_consistent_files(tmp_path):
    import papermill

    trace = small_agentx(sessions=6, seed=3)
    trace_path = tmp_path / "trace.jsonl"
    write_trace(trace, trace_path)
    out = tmp_path / "run"
    params = dict(layout="dp2", concurrency=3, duration_s=90, warmup_s=10, trace=str(trace_path),
                  router="session_sticky", max_num_batched_tokens=4096, seed=1,
                  output_dir=str(out))
    papermill.execute_notebook(str(AGENTX_REPLAY), str(tmp_path / "executed.ipynb"),
                               parameters=params, kernel_name="python3", progress_bar=False,
                               cwd=str(AGENTX_REPLAY.parent))

    assert sorted(p.name for p in out.iterdir()) == ["requests.parquet", "steps.parquet",
                                                    "summary.json"]
    summary = json.loads((out / "summary.json").read_text())
    requests = pd.read_parquet(out / "requests.parquet")
    steps = pd.read_parquet(out / "steps.parquet")

    # the parameters reached the engine and the replay
    assert summary["gpus"] == Layout.parse("dp2").gpus == 2
    assert (summary["layout"], summary["model"], summary["hardware"]) == \
        ("dp2", "llama-3.1-8b", "h200")
    assert (summary["concurrency"], summary["router"], summary["warmup_s"]) == \
        (3, "session_sticky", 10)
    assert summary["sim_duration_s"] == 90 and summary["open_loop"] is False

    # requests.parquet is every call that arrived; the summary counts the measured ones
    assert len(requests) == summary["requests_arrived"] > 0
    measured = requests[requests["completed"] & (requests["arrival_s"] >= 10)
                        & (requests["finish_s"] <= 90)]
    assert len(measured) == summary["requests_completed"] > 0
    logical = (measured["input_tokens"] + measured["output_tokens"]).sum()
    assert summary["throughput_tok_s_per_gpu"] == pytest.approx(logical / 80 / 2)
    ratio = measured["e2el_s"] / measured["output_tokens"]
    assert summary["interactivity_p90_tok_s"] == pytest.approx(1 / np.percentile(ratio, 90))
    assert summary["preemptions"] == requests["preemptions"].sum()
    # calls come from the trace's sessions (later epochs add @n)
    sessions = {tr.session_id for tr in trace.requests}
    assert set(requests["session_id"].str.split("@").str[0]) <= sessions
    assert set(requests["rank"].dropna().astype(int)) <= {0, 1}

    # steps.parquet: one row per step per rank, as the summary says
    assert set(steps["rank"]) == {0, 1}
    assert steps["step"].nunique() == summary["steps"]
    assert steps["kv_usage"].max() == pytest.approx(summary["kv_cache_usage_peak"])
    assert steps["start_s"].max() <= 90

    # the notebook printed the same numbers and drew its figures
    nb = nbformat.read(tmp_path / "executed.ipynb", as_version=4)
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.outputs if o.output_type == "stream")
    assert f"requests.parquet  {len(requests):,} calls" in text
    assert "gpus                       2\n" in text
    assert "llama-3.1-8b on 2 x h200, layout dp2: 2 DP rank(s)" in text
    figures = sum("application/vnd.plotly.v1+json" in o.get("data", {})
                  for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert figures == 3


@pytest.mark.parametrize(("notebook", "own", "expected"), [
    (AGENTX_REPLAY, ("trace", "max_model_len"),
     {"hardware", "warmup_s", "start_part_way", "max_idle_s", "loop_trace", "router",
      "max_num_batched_tokens", "seed"}),
    (TRACE_REPLAY, ("trace", "slo", "percentiles", "gpu_hour_usd"),
     {"hardware", "router", "max_num_batched_tokens", "max_num_seqs", "seed", "on_oversize",
      "window", "speedup"}),
])
def test_notebook_and_cli_defaults_agree(notebook, own, expected):
    """A parameter the notebook shares with `labkit replay` has the CLI's default. Not
    compared: what the command line requires (concurrency, duration_s), the trace the
    notebook generates (agentx_replay: with max_model_len to fit it), and the service
    levels trace_replay shows by default."""
    import ast

    from labkit.cli import build_parser
    from labkit.specs import EngineConfig

    cell = next(c for c in nbformat.read(notebook, as_version=4).cells
                if "parameters" in c.metadata.get("tags", []))
    params = {node.targets[0].id: ast.literal_eval(node.value)
              for node in ast.parse(cell.source).body if isinstance(node, ast.Assign)
              and node.targets[0].id not in own}
    replay = build_parser()._subparsers._group_actions[0].choices["replay"]
    knobs = EngineConfig()
    cli = {a.dest: a.default if a.default is not None else getattr(knobs, a.dest, None)
           for a in replay._actions
           if not a.required and a.dest not in ("concurrency", "duration_s")}
    shared = set(params) & set(cli)
    assert expected <= shared
    for name in shared:
        assert params[name] == cli[name], f"{name}: notebook {params[name]!r}, CLI {cli[name]!r}"
