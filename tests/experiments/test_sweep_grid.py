"""`labkit sweep` over the real agentx_replay notebook: a 4-point grid, its results
table, compare.ipynb over it, and a grid with an impossible layout."""

from __future__ import annotations

import json

import nbformat
import pandas as pd
import pytest

from labkit import Layout
from sweep_helpers import AGENTX_REPLAY, COMPARE, sweep, tiny_notebook, tree

GRID = [("layout", "tp1,tp2"), ("concurrency", "2,8")]
FIXED = [("duration_s", "60"), ("num_sessions", "8")]
NAMES = ["00_layout=tp1,concurrency=2", "01_layout=tp1,concurrency=8",
         "02_layout=tp2,concurrency=2", "03_layout=tp2,concurrency=8"]


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "grid"
    argv = [AGENTX_REPLAY]
    for name, values in GRID + FIXED:
        argv += ["-p", name, values]
    rc = sweep([*argv, "--out", out, "--jobs", "2"])
    return rc, out


def test_four_points_give_four_executed_notebooks(grid):
    rc, out = grid
    assert rc == 0
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == NAMES
    assert {"results.parquet", "sweep.json"} <= set(tree(out))
    for name in NAMES:
        assert {"notebook.ipynb", "requests.parquet", "steps.parquet", "summary.json"} <= \
            set(tree(out / name))
        nb = nbformat.read(out / name / "notebook.ipynb", as_version=4)
        injected = [c for c in nb.cells if "injected-parameters" in c.metadata.get("tags", [])]
        assert len(injected) == 1 and f"output_dir = \"{out / name}\"" in injected[0].source
        outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
        assert not [o for o in outputs if o.output_type == "error"]
        assert any("application/vnd.plotly.v1+json" in o.get("data", {}) for o in outputs)
        assert nb.metadata.kernelspec.name == "python3"


def test_results_rows_differ_as_the_parameters_say(grid):
    _, out = grid
    results = pd.read_parquet(out / "results.parquet")
    assert len(results) == 4
    assert list(results.columns[:8]) == ["layout", "concurrency", "duration_s", "num_sessions",
                                         "run", "status", "error", "run_s"]
    assert results["run"].tolist() == NAMES
    assert results["status"].tolist() == ["ok"] * 4 and results["error"].isna().all()
    assert results["layout"].tolist() == ["tp1", "tp1", "tp2", "tp2"]
    assert results["concurrency"].tolist() == [2, 8, 2, 8]
    # summary keys that are also parameters are prefixed; the others keep their names
    assert results["summary.layout"].tolist() == results["layout"].tolist()
    assert results["summary.concurrency"].tolist() == results["concurrency"].tolist()
    assert results["gpus"].tolist() == [Layout.parse(lay).gpus for lay in results["layout"]]
    for _, rows in results.groupby("layout"):
        low, high = rows.sort_values("concurrency").to_dict("records")
        # more sessions in flight: more calls, more tokens per GPU, slower per user
        assert high["requests_arrived"] > low["requests_arrived"]
        assert high["throughput_tok_s_per_gpu"] > low["throughput_tok_s_per_gpu"]
        assert high["ttft_p90_s"] > low["ttft_p90_s"]
    for _, rows in results.groupby("concurrency"):
        tp1, tp2 = rows.sort_values("layout").to_dict("records")
        assert tp2["tpot_p50_s"] < tp1["tpot_p50_s"]  # half the weights to read per GPU
    # each row is its run's summary.json
    for row in results.to_dict("records"):
        summary = json.loads((out / row["run"] / "summary.json").read_text())
        for key, value in summary.items():
            column = f"summary.{key}" if key in ("layout", "concurrency", "duration_s") else key
            if isinstance(value, list):  # lists (the warnings) are kept as JSON text
                value = json.dumps(value)
            assert row[column] == pytest.approx(value, nan_ok=True) \
                if isinstance(value, float) else row[column] == value
    plan = json.loads((out / "sweep.json").read_text())
    assert plan["parameters"] == {"layout": ["tp1", "tp2"], "concurrency": [2, 8],
                                  "duration_s": [60], "num_sessions": [8]}
    assert plan["runs"] == NAMES


def test_compare_notebook_draws_the_frontier_of_the_sweep(grid, tmp_path):
    import papermill

    _, out = grid
    executed = tmp_path / "compare.ipynb"
    papermill.execute_notebook(str(COMPARE), str(executed), parameters={"sweep_dir": str(out)},
                               kernel_name="python3", progress_bar=False,
                               cwd=str(COMPARE.parent))
    nb = nbformat.read(executed, as_version=4)
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.outputs if o.output_type == "stream")
    assert "4 runs, 4 ok, 0 failed" in text
    assert "layout (swept), concurrency (swept)" in text
    assert "matches summary.json: True" in text
    figures = [o.data["application/vnd.plotly.v1+json"] for c in nb.cells
               if c.cell_type == "code" for o in c.outputs
               if "application/vnd.plotly.v1+json" in o.get("data", {})]
    frontier = figures[0]
    names = [trace.get("name") for trace in frontier["data"]]
    assert names == ["layout=tp1", "layout=tp2", "Pareto frontier"]


def test_an_impossible_layout_fails_alone(tmp_path, capsys):
    out = tmp_path / "out"
    rc = sweep([AGENTX_REPLAY, "-p", "layout", "tp1,tp3", "-p", "concurrency", "2",
                "-p", "duration_s", "30", "-p", "num_sessions", "4", "--out", out,
                "--jobs", "2"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "run 01_layout=tp3 failed: ConfigError: layout 'tp3'" in err
    assert "1 of 2 runs failed (01_layout=tp3)" in err
    results = pd.read_parquet(out / "results.parquet")
    ok, failed = results.to_dict("records")
    assert (ok["run"], ok["status"], ok["gpus"]) == ("00_layout=tp1", "ok", 1)
    assert pd.isna(ok["error"]) and ok["requests_completed"] > 0
    assert failed["status"] == "failed" and failed["error"].startswith("ConfigError: layout")
    assert pd.isna(failed["gpus"]) and pd.isna(failed["throughput_tok_s_per_gpu"])
    assert tree(out / "01_layout=tp3") == ["notebook.ipynb"]  # kept, with the traceback
    nb = nbformat.read(out / "01_layout=tp3" / "notebook.ipynb", as_version=4)
    assert any(o.output_type == "error" for c in nb.cells if c.cell_type == "code"
               for o in c.outputs)
    assert {"requests.parquet", "steps.parquet", "summary.json"} <= set(tree(out / "00_layout=tp1"))


def test_a_value_with_equals_signs_and_commas_is_one_parameter(tmp_path, capfd):
    """`label = "a=1,b=2"` (an SLO string's shape) is a parameter though papermill's own
    reader skips its line; the sweep runs it quietly, the value reaching the run whole."""
    notebook = tiny_notebook(tmp_path / "tiny.ipynb",
                             'x = 1\nlabel = "ttft=2,tpot=0.05"  # two =\noutput_dir = None')
    out = tmp_path / "out"
    assert sweep([notebook, "-p", "label", '"ttft=1,tpot=0.02"', "-p", "x", "1,4",
                  "--out", out, "--no-progress"]) == 0
    err = capfd.readouterr().err
    assert "Unable to parse" not in err and "unknown parameter" not in err
    results = pd.read_parquet(out / "results.parquet")
    assert results["label"].tolist() == ["ttft=1,tpot=0.02"] * 2
    assert results["summary.label"].tolist() == ["ttft=1,tpot=0.02"] * 2
