"""`labkit bench sim --against REF`: this tree and an earlier revision, alternated, each in
a fresh process, on the fast workload of `labkit bench sim`."""

import subprocess

import pytest

from labkit.bench_against import bench_against, source_tree
from labkit.errors import ConfigError


def _tree_is_committed() -> bool:
    root = source_tree()
    done = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "labkit"],
                          capture_output=True, text=True, check=True)
    return done.stdout.strip() == ""


def test_against_head_replays_both_in_turn_and_they_agree(capsys):
    df = bench_against("HEAD", duration_s=3.0, rounds=1)
    assert list(df["code"]) == ["this tree", "HEAD"]  # alternated, this tree first
    assert (df["sim_s"] == 3.0).all() and (df["steps"] > 0).all() and (df["cpu_s"] > 0).all()
    assert (df["steps_per_cpu_s"] == df["steps"] / df["cpu_s"]).all()
    assert (df["warmup_cpu_s"] > 0).all()  # each process loaded its loops before the clock
    if _tree_is_committed():  # the same code: the same steps (a replay is deterministic)
        assert df["steps"].nunique() == 1
    out = capsys.readouterr().out
    assert "this tree takes" in out and "HEAD" in out
    # the figure: least CPU time of each (the most steps per CPU second), and the medians'
    best = df.groupby("code", sort=False)["steps_per_cpu_s"].max()
    assert f"takes {best.iloc[0] / best.iloc[1]:.2f}x" in out and "medians: " in out


def test_a_revision_git_does_not_know_is_refused_before_anything_runs(capsys):
    with pytest.raises(ConfigError, match="not a revision"):
        bench_against("no-such-revision-here", duration_s=3.0)
    assert "CPU s" not in capsys.readouterr().out  # nothing was replayed
