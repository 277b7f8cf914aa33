"""`labkit bench traces`: each step timed both ways (compiled id lists or json alone;
CSV columns or rows), the two checked to give the same bytes and requests — and a
difference is told."""

import numpy as np

from labkit import bench_traces
from labkit.cli import main


def test_the_command_runs_the_bench(monkeypatch):
    calls = []
    monkeypatch.setattr(bench_traces, "bench_traces", lambda quick: calls.append(quick))
    assert main(["bench", "traces", "--quick"]) == 0 and calls == [True]


def test_the_quick_bench_prints_every_step_and_finds_both_ways_identical(capsys):
    table = bench_traces.bench_traces(quick=True)
    out = capsys.readouterr().out
    for step in ("generate AgentX", "write labkit JSONL", "load labkit JSONL",
                 "load AgentX objects", "trace stats", "load BurstGPT CSV", "load Azure 2024 CSV",
                 "prefix reuse"):
        assert step in out
    single = table["step"].isin(["generate AgentX", "trace stats"])
    assert (table.loc[single, "cpu_s"] > 0).all()
    steps = table[~single]
    assert len(steps) == 5 and steps["identical"].tolist() == [True] * 5
    assert (steps["MB"] > 0.5).all() and np.isfinite(steps["speedup"]).all()


def test_requests_that_differ_are_told():
    from labkit.traces import generate_agentx_trace

    a = generate_agentx_trace(2, seed=0, context_window_tokens=40_000,
                              compact_threshold_tokens=20_000)
    b = generate_agentx_trace(2, seed=0, context_window_tokens=40_000,
                              compact_threshold_tokens=20_000)
    assert bench_traces._same_requests(a, b)
    b.requests[-1].hash_ids = b.requests[-1].hash_ids.copy()
    b.requests[-1].hash_ids[-1] += 1
    assert not bench_traces._same_requests(a, b)
