"""Metrics: the tables agree with the engine's events, the summary with its formulas."""

import numpy as np
import pandas as pd
import pytest

from support import small_agentx
from labkit import Engine
from labkit.engine.events import FirstToken, RequestFinished, StepsCompleted


@pytest.fixture(scope="module")
def run():
    engine = Engine("tiny-qwen3-moe", "dep2", "h200", block_size=16, router="session_sticky",
                    num_speculative_tokens=2, acceptance_length=2.5)
    finished = []
    engine.events.subscribe(lambda e: finished.append(e.request), RequestFinished)
    result = engine.replay(small_agentx(6, seed=8), concurrency=4, duration_s=90,
                           warmup_s=10)
    return engine, result, finished


def test_request_rows_match_finished_requests(run):
    _, result, finished = run
    req = result.requests.set_index("request_id")
    assert len(finished) == int(req["completed"].sum()) > 10
    for r in finished:
        row = req.loc[r.request_id]
        assert row["ttft_s"] == r.first_token_s - r.arrival_s
        assert row["e2el_s"] == r.finish_s - r.arrival_s
        assert row["output_tokens"] == r.max_output_tokens == r.trace.output_length
        assert row["input_tokens"] == r.trace.input_length
        if r.num_output_tokens > 1:
            assert row["tpot_s"] == pytest.approx((r.finish_s - r.first_token_s)
                                                  / (r.num_output_tokens - 1))
            # ITL samples add up to the decode time
            assert sum(r.itl) == pytest.approx(r.finish_s - r.first_token_s)
        assert 0 <= row["cached_tokens"] < row["input_tokens"]


def test_summary_follows_its_definitions(run):
    engine, result, _ = run
    s, req = result.summary, result.requests
    window = req[req["completed"] & (req["arrival_s"] >= 10) & (req["finish_s"] <= 90)]
    gpus = engine.layout.gpus
    assert s["gpus"] == gpus == 2
    assert s["requests_completed"] == len(window)
    assert s["throughput_tok_s_per_gpu"] == pytest.approx(
        (window["input_tokens"] + window["output_tokens"]).sum() / 80 / gpus)
    assert s["output_tok_s_per_gpu"] == pytest.approx(window["output_tokens"].sum() / 80 / gpus)
    assert s["interactivity_p90_tok_s"] == pytest.approx(
        1 / np.percentile(window["e2el_s"] / window["output_tokens"], 90))
    assert s["ttft_p50_s"] == pytest.approx(np.percentile(window["ttft_s"], 50))
    admitted = req[req["first_scheduled_s"].notna()]
    assert s["prefix_cache_hit_rate"] == pytest.approx(
        admitted["cached_tokens"].sum() / admitted["input_tokens"].sum())
    assert s["kv_cache_usage_peak"] == result.steps["kv_usage"].max()
    assert s["preemptions"] == req["preemptions"].sum()


def test_steps_table_is_per_step_per_rank(run):
    engine, result, _ = run
    steps = result.steps
    assert set(steps["rank"]) == {0, 1}
    per_step = steps.groupby("step")
    assert (per_step.size() == 2).all()  # lockstep: both ranks every step
    # a step lasts as long as its slowest rank; the other one stalls for the difference
    assert np.allclose(per_step["busy_s"].max(), per_step["duration_s"].first())
    assert np.allclose(steps["stall_s"], steps["duration_s"] - steps["busy_s"])
    assert (steps["stall_s"] >= 0).all() and (steps["stall_s"] > 0).any()
    assert (steps["kv_used_blocks"] <= engine.num_blocks_per_rank).all()
    # consecutive steps of the instance are back to back while it is busy
    starts = per_step["start_s"].first().to_numpy()
    ends = starts + per_step["duration_s"].first().to_numpy()
    assert (starts[1:] >= ends[:-1] - 1e-12).all()


def test_result_saves_parquet_and_json(run, tmp_path):
    _, result, _ = run
    result.save(tmp_path / "out")
    import json

    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == \
        ["requests.parquet", "steps.parquet", "summary.json"]
    back = pd.read_parquet(tmp_path / "out" / "requests.parquet")
    pd.testing.assert_frame_equal(back, result.requests)
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["gpus"] == 2


def test_event_subscription_costs_nothing_when_unused():
    engine = Engine("tiny-llama", "tp1", "h200")
    assert not engine.events.wants(FirstToken)
    seen = []
    sub = engine.events.subscribe(seen.append, StepsCompleted)
    assert engine.events.wants(StepsCompleted) and not engine.events.wants(FirstToken)
    sub.unsubscribe()
    # the metrics recorder still listens to steps; nothing else is wanted
    assert not engine.events.wants(FirstToken)
    with engine.events.subscribe(seen.append) as everything:
        assert engine.events.wants(FirstToken)
    assert not engine.events.wants(FirstToken)
    del everything


def test_every_event_type_is_documented():
    import inspect
    from pathlib import Path

    from labkit.engine import events

    doc = (Path(__file__).resolve().parents[2] / "docs" / "events.md").read_text()
    kinds = [c for _, c in inspect.getmembers(events, inspect.isclass)
             if issubclass(c, events.Event) and c is not events.Event]
    assert len(kinds) >= 15
    for cls in kinds:
        assert f"`{cls.__name__}`" in doc, cls.__name__
        for name in cls.__dataclass_fields__:
            if name != "t":
                assert name in doc, f"{cls.__name__}.{name}"


def test_result_of_a_hand_driven_run_and_local_hit_rate():
    engine = Engine("llama-3.1-8b", "dp2", "h200", router="round_robin")
    engine.start_replay(small_agentx(4, seed=6), concurrency=3, duration_s=60,
                        start_part_way=False)
    for _ in range(200):
        engine.step()
    result = engine.result()
    req = result.requests
    assert len(req) > 5 and result.summary["sim_duration_s"] == engine.now
    admitted = req[req["first_scheduled_s"].notna()]
    local = (admitted["cached_tokens"] - admitted["fetched_tokens"]).sum()
    assert result.summary["prefix_cache_local_hit_rate"] == pytest.approx(
        local / admitted["input_tokens"].sum())
    assert result.summary["prefix_cache_local_hit_rate"] < \
        result.summary["prefix_cache_hit_rate"]  # round robin moves sessions: fetches


def test_finish_after_run_until_runs_the_replay_to_its_end():
    """Watching a replay part-way (`engine.run_until`) then finishing it gives the
    replay run in one go (run_until's stop must not stay the replay's end)."""
    results = []
    for looks in ((), (11.0, 23.5)):
        engine = Engine("llama-3.1-8b", "dp2", "h200", router="round_robin")
        run = engine.start_replay(small_agentx(4, seed=6), concurrency=3, duration_s=60,
                                  start_part_way=False)
        for t in looks:
            engine.run_until(t)
            assert engine.now < t
        results.append(run.finish())
    whole, watched = results
    assert whole.summary["sim_duration_s"] == watched.summary["sim_duration_s"] == 60
    pd.testing.assert_frame_equal(whole.requests, watched.requests, check_exact=True)
    pd.testing.assert_frame_equal(whole.steps, watched.steps, check_exact=True)


def test_stall_share_is_the_mean_waiting_fraction(run):
    _, result, _ = run
    st = result.steps
    window = st[(st["start_s"] >= 10) & (st["start_s"] < 90)]
    assert result.summary["stall_share"] == pytest.approx(window["stall_s"].sum() / 2 / 80)
