"""`labkit bench sim --repeat N`: each replay timed N times, the least CPU time kept
(with its wall time) and the median, and whether every repeat gave the same result."""

from types import SimpleNamespace

import pandas as pd

from labkit import bench_sim


def _result(x: float):
    return SimpleNamespace(requests=pd.DataFrame({"x": [x]}), steps=pd.DataFrame({"y": [1]}),
                           summary={"steps": 3, "wall_s": x})


def test_the_least_cpu_time_is_kept_with_its_wall_time_and_the_median(monkeypatch):
    runs = iter([(_result(1.0), 5.0, 50.0), (_result(1.0), 3.0, 30.0),
                 (_result(1.0), 4.0, 40.0), (_result(1.0), 9.0, 90.0)])
    monkeypatch.setattr(bench_sim, "timed_replay", lambda *a, **k: next(runs))
    first, cpu, wall, median, same = bench_sim._repeated({}, None, 1.0, True, 4)
    assert (cpu, wall, median, same) == (3.0, 30.0, 4.5, True)
    assert first.requests["x"].tolist() == [1.0]


def test_a_repeat_that_differs_is_told(monkeypatch):
    runs = iter([(_result(1.0), 5.0, 50.0), (_result(2.0), 3.0, 30.0)])
    monkeypatch.setattr(bench_sim, "timed_replay", lambda *a, **k: next(runs))
    assert bench_sim._repeated({}, None, 1.0, True, 2)[4] is False


def test_one_run_is_itself(monkeypatch):
    runs = iter([(_result(1.0), 5.0, 50.0)])
    monkeypatch.setattr(bench_sim, "timed_replay", lambda *a, **k: next(runs))
    assert bench_sim._repeated({}, None, 1.0, True, 1)[1:] == (5.0, 50.0, 5.0, True)


def test_the_open_loop_load_reports_its_own_replay(capsys):
    """`labkit bench sim` (c): the figures it returns are those of the replay it ran
    (the steps' mean batch from the steps table, times real time from its CPU time)."""
    row = bench_sim.bench_open_loop(num_prompts=60, repeat=2)
    assert row["steps"] > 0 and row["sim_s"] > 0
    assert row["x_real_time"] == row["sim_s"] / row["cpu_s"]
    assert 1 <= row["requests_per_step"] <= 60
    out = capsys.readouterr().out
    assert "60 random prompts at 16/s" in out and "(least of 2)" in out
