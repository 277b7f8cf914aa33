"""Where a replay's window ends, and what its progress bar counts.

A closed loop without `loop_trace` runs out of calls; with a `duration_s` longer than
that, the summary's window must end where the run did (throughput over the time the
run covered, not over idle time after it). The progress bar counts whole simulated
seconds up to the duration, or calls when there is none, and ends full.
"""

import math

import pytest

from labkit import Engine
from labkit.engine import replay as replay_module
from support import small_agentx


def test_a_trace_that_runs_out_ends_the_window_where_it_ran_out():
    trace = small_agentx(3, seed=5)
    engine = Engine("llama-3.1-8b", "tp1", "h200", block_size=16)
    result = engine.replay(trace, concurrency=3, duration_s=10_000, loop_trace=False,
                           warmup_s=5.0)
    req, s = result.requests, result.summary
    assert req["completed"].all() and len(req) == len(trace.requests)
    end = req["finish_s"].max()  # the last thing that happened
    assert end < 2_000
    assert s["sim_duration_s"] == end and s["window_s"] == end - 5.0
    measured = req[req["arrival_s"] >= 5.0]
    logical = (measured["input_tokens"] + measured["output_tokens"]).sum()
    assert s["throughput_tok_s_per_gpu"] == pytest.approx(logical / (end - 5.0))


def test_a_run_stopped_by_its_duration_keeps_the_duration():
    engine = Engine("llama-3.1-8b", "tp1", "h200", block_size=16)
    s = engine.replay(small_agentx(3, seed=5), concurrency=3, duration_s=30.0).summary
    assert s["sim_duration_s"] == 30.0 == s["window_s"]


class Bar:
    """Stands in for tqdm: records what the replay tells it."""

    made: list = []

    def __init__(self, total, unit, desc):
        self.total, self.unit, self.n, self.updates = total, unit, 0, []
        Bar.made.append(self)

    def update(self, k):
        self.updates.append(k)
        self.n += k

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture
def bar(monkeypatch):
    Bar.made = []
    monkeypatch.setattr(replay_module, "tqdm", Bar)
    return Bar


def _whole(b) -> None:
    assert isinstance(b.total, int) and all(isinstance(k, int) and k >= 0 for k in b.updates)
    assert b.n == b.total


def test_progress_counts_simulated_seconds_up_to_the_duration(bar):
    engine = Engine("llama-3.1-8b", "tp1", "h200", block_size=16)
    engine.replay(small_agentx(3, seed=5), concurrency=3, duration_s=45.5, progress=True)
    (b,) = bar.made
    assert (b.unit, b.total) == ("sim s", 46)
    _whole(b)
    assert len(b.updates) > 10  # it moved along, not in one jump at the end


def test_progress_ends_where_a_finished_trace_ended(bar):
    engine = Engine("llama-3.1-8b", "tp1", "h200", block_size=16)
    result = engine.replay(small_agentx(3, seed=5), concurrency=3, duration_s=10_000,
                           loop_trace=False, progress=True)
    (b,) = bar.made
    assert b.total == math.ceil(result.summary["sim_duration_s"]) < 10_000
    _whole(b)


@pytest.mark.parametrize("part_way", [False, True])
def test_progress_counts_calls_without_a_duration(bar, part_way):
    trace = small_agentx(4, seed=6)
    engine = Engine("llama-3.1-8b", "tp1", "h200", block_size=16)
    result = engine.replay(trace, concurrency=2, loop_trace=False, start_part_way=part_way,
                           progress=True)
    (b,) = bar.made
    assert b.unit == "call"
    assert b.total == len(result.requests) == result.requests["completed"].sum()
    if part_way:  # the first sessions skip their early calls: those never come
        assert b.total < len(trace.requests)
    _whole(b)
