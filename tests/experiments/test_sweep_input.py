"""`labkit sweep` input handling: value parsing, run names, the results columns, and
bad input (exit 2, nothing run, nothing written). No notebook is executed here."""

from __future__ import annotations

import math

import nbformat

import numpy as np
import pandas as pd
import pytest

from labkit.experiments import SweepInputError, pareto_mask, parse_values, plan_sweep
from labkit.experiments.sweep import (
    RunOutcome, collect_results, flatten, notebook_parameters, parse_parameter_args,
    parse_value, run_name,
)
from sweep_helpers import AGENTX_REPLAY, sweep, tiny_notebook, tree


# ------------------------------------------------------------------------ values
@pytest.mark.parametrize("text, value", [
    ("8", 8), ("-3", -3), ("2.99", 2.99), ("1e3", 1000.0), ("True", True), ("false", False),
    ("None", None), ("null", None), ("tp8", "tp8"), ("llama-3.1-8b", "llama-3.1-8b"),
    ("'8'", "8"), ('"None"', "None"), ("runs/a b", "runs/a b"),
])
def test_values_are_typed_like_papermill(text, value):
    parsed = parse_value(text)
    assert parsed == value and type(parsed) is type(value)


def test_value_lists_split_on_commas_outside_quotes():
    assert parse_values("layout", "tp8,dep8, tp4xpp2") == ["tp8", "dep8", "tp4xpp2"]
    assert parse_values("x", '1,"a,b",None') == [1, "a,b", None]
    assert parse_parameter_args([("a", "1,2"), ("b", "x")]) == {"a": [1, 2], "b": ["x"]}


@pytest.mark.parametrize("text", ["1,,2", "", ",", "1,", '"a,b'])
def test_malformed_value_lists_are_refused(text):
    with pytest.raises(SweepInputError):
        parse_values("x", text)


def test_run_names_are_deterministic_readable_and_unique():
    plan = plan_sweep(AGENTX_REPLAY, {"model": ["llama-3.1-8b"], "layout": ["tp1", "tp2"],
                                      "trace": ["runs/a b.jsonl", None]}, "unused")
    assert plan.names == ["00_layout=tp1,trace=runs_a_b.jsonl", "01_layout=tp1,trace=None",
                          "02_layout=tp2,trace=runs_a_b.jsonl", "03_layout=tp2,trace=None"]
    assert plan.points[1] == {"model": "llama-3.1-8b", "layout": "tp1", "trace": None}
    assert run_name(7, 120, {"x": 0.5}, ["x"]) == "007_x=0.5"
    assert run_name(0, 1, {"x": 1}, []) == "00"


def test_agentx_replay_defines_the_documented_parameters():
    defined = notebook_parameters(AGENTX_REPLAY)
    for name in ["model", "layout", "hardware", "concurrency", "duration_s", "warmup_s", "trace",
                 "num_sessions", "max_num_batched_tokens", "max_num_seqs",
                 "long_prefill_token_threshold", "prefill_schedule_interval", "router",
                 "num_speculative_tokens", "acceptance_length", "kv_cache_dtype", "seed",
                 "output_dir"]:
        assert name in defined, name
    assert defined["trace"]["default"] == "None"
    assert defined["output_dir"]["default"] == "None"


@pytest.mark.parametrize("notebook", ["plan.ipynb", "trace_replay.ipynb"])
def test_every_assignment_of_the_parameters_cell_is_a_parameter(notebook, tmp_path):
    """`slo = "ttft=3,tpot=0.03"` holds two `=`: papermill's own reader skips such a line,
    and a sweep over -p slo was refused. Each name the cell assigns is one, with its
    default and its comment; a value with commas is one value when quoted."""
    import ast

    path = AGENTX_REPLAY.parent / notebook
    cell = next(c for c in nbformat.read(path, as_version=4).cells
                if "parameters" in c.metadata.get("tags", []))
    assigned = [n.targets[0].id for n in ast.parse(cell.source).body
                if isinstance(n, ast.Assign)]
    defined = notebook_parameters(path)
    assert list(defined) == assigned and "slo" in defined
    assert ast.literal_eval(defined["slo"]["default"]).startswith("ttft=")
    if "output_dir" in defined:  # (plan.ipynb is not one to sweep)
        plan = plan_sweep(path, parse_parameter_args([["slo", '"ttft=1,tpot=0.05"']]),
                          tmp_path / "out")
        assert plan.points == [{"slo": "ttft=1,tpot=0.05"}]


def test_a_parameters_cell_that_is_not_python_is_named(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "x = 1\n%matplotlib inline\n", metadata={"tags": ["parameters"]})])
    path = tmp_path / "magic.ipynb"
    nbformat.write(nb, path)
    with pytest.raises(SweepInputError, match=r"parameters cell is not Python \(line 2"):
        notebook_parameters(path)


# ----------------------------------------------------------------------- results
def test_results_columns_keep_types_and_prefix_clashing_summary_keys(tmp_path):
    plan = plan_sweep(AGENTX_REPLAY, {"concurrency": [2, 4, 8]}, tmp_path / "out")
    for name, gpus in zip(plan.names[:2], (1, 2)):
        (plan.out / name).mkdir(parents=True)
        (plan.out / name / "summary.json").write_text(
            f'{{"gpus": {gpus}, "concurrency": 9, "throughput_tok_s_per_gpu": 1.5, '
            f'"model": "m", "open_loop": false, "extra": {{"a": 1}}}}')
    outcomes = [RunOutcome(plan.names[0], "ok", None, 1.0),
                RunOutcome(plan.names[1], "ok", None, 2.0),
                RunOutcome(plan.names[2], "failed", "ConfigError: no", 0.5)]
    frame = collect_results(plan, outcomes)
    assert list(frame.columns[:5]) == ["concurrency", "run", "status", "error", "run_s"]
    assert "summary.concurrency" in frame and frame["summary.concurrency"].iloc[0] == 9
    assert frame["extra.a"].tolist()[:2] == [1, 1]
    assert str(frame["gpus"].dtype) == "Int64" and frame["gpus"].isna().tolist() == [0, 0, 1]
    assert str(frame["open_loop"].dtype) == "boolean"
    assert frame["error"].tolist() == [None, None, "ConfigError: no"]
    frame.to_parquet(tmp_path / "r.parquet")  # one type per column
    back = pd.read_parquet(tmp_path / "r.parquet")
    assert back["gpus"].tolist()[:2] == [1, 2] and back["model"].tolist()[:2] == ["m", "m"]


def test_flatten_and_mixed_parameter_columns(tmp_path):
    assert flatten({"a": {"b": 1, "c": {"d": 2}}, "e": [1, 2]}) == \
        {"a.b": 1, "a.c.d": 2, "e": "[1, 2]"}
    plan = plan_sweep(AGENTX_REPLAY, {"acceptance_length": [None, 2, 2.5],
                                      "trace": [None]}, tmp_path / "o")
    frame = collect_results(plan, [RunOutcome(n, "failed", "x", 0.0) for n in plan.names])
    assert frame["acceptance_length"].dtype == float
    assert math.isnan(frame["acceptance_length"][0])
    frame.to_parquet(tmp_path / "r.parquet")


def test_pareto_mask():
    x = [1.0, 2.0, 3.0, 2.0, np.nan, 0.5]
    y = [5.0, 4.0, 1.0, 3.0, 9.0, 5.0]
    assert pareto_mask(x, y).tolist() == [True, True, True, False, False, False]


# --------------------------------------------------------------------- bad input
BAD_INPUTS = [
    (["missing.ipynb", "-p", "layout", "tp1"], "not found"),
    ([AGENTX_REPLAY, "-p", "layuot", "tp1,tp2"], "does not define 'layuot'"),
    ([AGENTX_REPLAY, "-p", "layout", "tp1,,tp2"], "empty value"),
    ([AGENTX_REPLAY, "-p", "layout", "tp1", "-p", "layout", "tp2"], "given twice"),
    ([AGENTX_REPLAY, "-p", "layout", "tp1,tp1"], "repeated"),
    ([AGENTX_REPLAY, "-p", "output_dir", "x"], "the sweep sets it"),
    ([AGENTX_REPLAY, "-p", "layout", "tp1", "--jobs", "0"], "--jobs"),
]


@pytest.mark.parametrize("argv, message", BAD_INPUTS)
def test_bad_input_exits_2_and_writes_nothing(tmp_path, capsys, argv, message):
    out = tmp_path / "out"
    assert sweep([*argv, "--out", out]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("labkit sweep: error:")
    assert not out.exists()


def test_notebooks_without_what_a_sweep_needs_exit_2(tmp_path, capsys):
    untagged = tiny_notebook(tmp_path / "untagged.ipynb", tagged=False)
    no_output = tiny_notebook(tmp_path / "no_output.ipynb", parameters="x = 1\nlabel = 'a'")
    not_json = tmp_path / "broken.ipynb"
    not_json.write_text("{ not a notebook")
    for notebook, message in [(untagged, "no cell is tagged 'parameters'"),
                              (no_output, "does not define 'output_dir'"),
                              (not_json, "not a readable notebook")]:
        assert sweep([notebook, "-p", "x", "1,2", "--out", tmp_path / "out"]) == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / "out").exists()


def test_a_missing_value_is_an_argparse_error(tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        sweep([AGENTX_REPLAY, "-p", "layout", "--out", tmp_path / "out"])
    assert exit_info.value.code == 2
    assert not (tmp_path / "out").exists()


def test_an_out_dir_with_files_needs_overwrite(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert sweep([AGENTX_REPLAY, "-p", "layout", "tp1", "--out", out]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert tree(out) == ["keep.txt"]


def test_labkit_cli_wires_sweep(tmp_path, capsys):
    from labkit import cli

    parser = cli.build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    if "sweep" not in commands:
        pytest.skip("`labkit sweep` is not wired into labkit/cli.py yet")
    assert cli.main(["sweep", str(tmp_path / "missing.ipynb"), "-p", "x", "1",
                     "--out", str(tmp_path / "out")]) == 2
    assert "not found" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
