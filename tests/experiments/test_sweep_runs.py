"""How a sweep runs its points, on a tiny notebook that costs only a kernel start:
failures of several kinds, the kernel's interpreter and working directory, quoted
values, overwriting."""

from __future__ import annotations

import sys

import pandas as pd

from labkit.experiments import run_sweep
from sweep_helpers import sweep, tiny_notebook, tree


def test_failures_are_reported_and_the_other_points_complete(tmp_path, capsys, monkeypatch):
    notebook = tiny_notebook(tmp_path / "tiny.ipynb")
    monkeypatch.chdir(tmp_path)
    rc = sweep([notebook, "-p", "x", "1,2,3", "-p", "label", '"8"', "--out", "out",
                "--jobs", "3"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "run 02_x=3 failed: ValueError: x=3 is impossible" in err
    assert "run 01_x=2 failed: MissingSummary" in err
    assert "2 of 3 runs failed (01_x=2, 02_x=3)" in err

    results = pd.read_parquet(tmp_path / "out" / "results.parquet")
    assert results["run"].tolist() == ["00_x=1", "01_x=2", "02_x=3"]
    assert results["status"].tolist() == ["ok", "failed", "failed"]
    assert results["label"].tolist() == ["8"] * 3  # quoted: a string, not an int
    row = results.iloc[0]
    assert row["summary.x"] == 1 and row["double"] == 2 and row["summary.label"] == "8"
    assert row["nested.a"] == 1 and row["nested.b"] == "[1, 2]"
    # the kernel ran on this interpreter, in the directory the sweep was started from
    assert row["executable"] == sys.executable
    assert row["cwd"] == str(tmp_path)
    assert results["double"].isna().tolist() == [False, True, True]
    for name in results["run"]:
        assert "notebook.ipynb" in tree(tmp_path / "out" / name)


def test_overwrite_replaces_the_runs_of_the_grid(tmp_path, capsys):
    notebook = tiny_notebook(tmp_path / "tiny.ipynb")
    out = tmp_path / "out"
    first = run_sweep(notebook, {"x": [1]}, out)
    assert first["run"].tolist() == ["00"] and first["double"].tolist() == [2]
    (out / "00" / "stale.txt").write_text("from before")
    assert sweep([notebook, "-p", "x", "5", "--out", out]) == 2
    assert sweep([notebook, "-p", "x", "5", "--out", out, "--overwrite", "--no-progress"]) == 0
    assert "1 run ok" in capsys.readouterr().out
    results = pd.read_parquet(out / "results.parquet")
    assert results["double"].tolist() == [10]
    assert "stale.txt" not in tree(out / "00")


def test_a_kernels_own_stderr_stays_off_the_terminal(tmp_path, capfd):
    """A run's kernel writes its log (e.g. ipykernel's "KeyboardInterrupt caught in
    kernel" when jupyter_client interrupts it before shutdown) to its process's stderr;
    that stream is dropped, while what the cells print still reaches the run's
    notebook."""
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    from labkit.experiments.sweep import execute_run

    nb = new_notebook(cells=[new_code_cell("output_dir = None"),
                             new_code_cell("import os, json\n"
                                           "os.write(2, b'kernel-process-stderr\\n')\n"
                                           "print('cell-output')\n"
                                           "json.dump({}, open(os.path.join(output_dir, "
                                           "'summary.json'), 'w'))")])
    nb.cells[0].metadata["tags"] = ["parameters"]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, tmp_path / "nb.ipynb")
    status, error, _ = execute_run(str(tmp_path / "nb.ipynb"), str(tmp_path / "run"), {},
                                   str(tmp_path))
    assert (status, error) == ("ok", None)
    assert "kernel-process-stderr" not in capfd.readouterr().err
    assert "cell-output" in (tmp_path / "run" / "notebook.ipynb").read_text()
