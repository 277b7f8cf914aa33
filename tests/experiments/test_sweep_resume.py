"""`labkit sweep --resume`: finished points stay untouched, lost and failed ones run
again; a resume into another sweep's folder is refused, naming the difference."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from labkit.experiments import SweepInputError, run_sweep
from sweep_helpers import sweep, tiny_notebook


def files(run_dir):
    """(inode, mtime_ns) of every file of a run folder."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in run_dir.iterdir()}


def test_resume_reruns_only_the_lost_and_the_failed_points(tmp_path, capsys):
    notebook = tiny_notebook(tmp_path / "tiny.ipynb")
    out = tmp_path / "out"
    argv = [notebook, "-p", "x", "1,3,4", "--out", out, "--jobs", "2", "--no-progress"]
    assert sweep(argv) == 1  # x=3 raises
    first = pd.read_parquet(out / "results.parquet")
    assert first["status"].tolist() == ["ok", "failed", "ok"]
    kept = files(out / "00_x=1")
    assert "run.json" in kept and "summary.json" in kept
    failed_before = files(out / "01_x=3")
    assert "run.json" not in failed_before  # a failed point is not complete
    lost = out / "02_x=4"
    for p in lost.iterdir():
        p.unlink()
    lost.rmdir()

    assert sweep(argv) == 2  # without --resume, the folder is refused
    assert "already holds files" in capsys.readouterr().err
    assert sweep([*argv, "--resume"]) == 1  # x=3 fails again
    err = capsys.readouterr().err
    assert "run 01_x=3 failed" in err
    assert "1 of 3 runs failed (01_x=3; 1 kept as they were, 2 run now)" in err
    assert files(out / "00_x=1") == kept  # untouched: same inodes, same mtimes
    assert files(out / "01_x=3")["notebook.ipynb"] != failed_before["notebook.ipynb"]
    assert json.loads((lost / "summary.json").read_text())["double"] == 8
    again = pd.read_parquet(out / "results.parquet")
    assert again["run"].tolist() == first["run"].tolist()
    assert again["status"].tolist() == ["ok", "failed", "ok"]
    columns = [c for c in first.columns if c not in ("run_s",)]
    pd.testing.assert_frame_equal(again[columns], first[columns])
    # the kept point's run_s is the one it took then
    assert again["run_s"].iloc[0] == first["run_s"].iloc[0]


def test_a_killed_run_without_its_marker_runs_again(tmp_path):
    notebook = tiny_notebook(tmp_path / "tiny.ipynb")
    out = tmp_path / "out"
    run_sweep(notebook, {"x": [1, 4]}, out)
    (out / "01_x=4" / "run.json").unlink()  # as if killed before the sweep marked it
    before = files(out / "00_x=1")
    frame = run_sweep(notebook, {"x": [1, 4]}, out, resume=True)
    assert frame["status"].tolist() == ["ok", "ok"] and frame.attrs["kept"] == 1
    assert files(out / "00_x=1") == before
    assert (out / "01_x=4" / "run.json").is_file()


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished two-point sweep that the refusal tests must leave as it is."""
    root = tmp_path_factory.mktemp("resume")
    notebook = tiny_notebook(root / "one.ipynb")
    run_sweep(notebook, {"x": [1, 4]}, root / "out")
    return notebook, root / "out"


@pytest.mark.parametrize("change, message", [
    ({"x": [1, 5]}, "-p x was 1,4 in"),
    ({"x": [1, 4], "label": ["b"]}, "this grid sweeps -p label"),
    ({}, "swept -p x 1,4; this grid does not"),
])
def test_resume_into_another_grid_is_refused(finished, change, message):
    notebook, out = finished
    before = sorted(p.name for p in out.rglob("*"))
    with pytest.raises(SweepInputError, match=message.replace("+", r"\+")):
        run_sweep(notebook, change, out, resume=True)
    assert sorted(p.name for p in out.rglob("*")) == before  # nothing written


def test_resume_with_another_notebook_or_a_foreign_folder_is_refused(finished, tmp_path,
                                                                    capsys):
    one, out = finished
    other = tiny_notebook(tmp_path / "other.ipynb")
    assert sweep([other, "-p", "x", "1,4", "--out", out, "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"is a sweep of {one}, not of {other}" in err and err.count("\n") == 1
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert sweep([one, "-p", "x", "1", "--out", foreign, "--resume"]) == 2
    assert "no sweep.json" in capsys.readouterr().err
    assert sweep([one, "-p", "x", "1", "--out", out, "--resume", "--overwrite"]) == 2
    assert "exclude each other" in capsys.readouterr().err


def test_an_unknown_executor_lists_the_allowed_ones(tmp_path, capsys):
    notebook = tiny_notebook(tmp_path / "tiny.ipynb")
    assert sweep([notebook, "-p", "x", "1", "--out", tmp_path / "o", "--executor", "dask"]) == 2
    assert "--executor 'dask' is not known; allowed: local, ray" in capsys.readouterr().err
    assert sweep([notebook, "-p", "x", "1", "--out", tmp_path / "o",
                  "--ray-address", "auto"]) == 2
    assert "--ray-address needs --executor ray" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
