"""Service-level metrics: goodput and SLO attainment as `vllm bench serve --goodput`
defines them, chosen percentiles, cost per million tokens and session completion
time -- on hand-made call tables (worked by hand) and on replays (recomputed from
requests.parquet the slow, obvious way)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from labkit import Engine
from labkit.engine.session_ledger import sessions_from_requests
from labkit.engine.slo import metric_options, percentile_key, service_summary
from labkit.errors import ConfigError
from labkit.traces import generate_multi_turn_trace, generate_random_trace


def _calls() -> pd.DataFrame:
    """Four measured calls (seconds)."""
    return pd.DataFrame({
        "request_id": ["a", "b", "c", "d"], "session_id": ["s", "s", "t", "u"],
        "ttft_s": [2.0, 3.0, 0.5, 1.5],          # a: exactly at the SLO counts as met
        "tpot_s": [0.04, 0.01, np.nan, 0.06],    # c made one token: TPOT 0 for goodput
        "e2el_s": [5.0, 4.0, 0.5, 9.0],
        "input_tokens": [1000, 2000, 500, 1500], "output_tokens": [100, 50, 1, 80],
        "arrival_s": [0.0, 1.0, 2.0, 3.0], "finish_s": [5.0, 5.0, 2.5, 12.0],
        "completed": [True, True, True, True]})


def _summary(calls, slo=None, percentiles=None, gpu_hour_usd=None, window=10.0, gpus=2):
    return service_summary(calls, np.array([0.01, 0.02, 0.03, 0.04]),
                           sessions_from_requests(calls),
                           metric_options(slo, percentiles, gpu_hour_usd), window=window,
                           gpus=gpus, warmup_s=0.0, end_s=window + 5)


def test_goodput_on_hand_made_calls():
    out = _summary(_calls(), slo="ttft=2,tpot=0.05")
    # good: a (2.0 <= 2, 0.04), c (0.5, TPOT 0); bad: b (TTFT 3), d (TPOT 0.06)
    assert out["goodput_req_s"] == 2 / 10 and out["goodput_req_s_per_gpu"] == 2 / 10 / 2
    assert out["slo_attainment"] == 0.5
    assert out["slo_ttft_attainment"] == 0.75 and out["slo_tpot_attainment"] == 0.75
    out = _summary(_calls(), slo={"e2el": 4.5})
    assert out["goodput_req_s"] == 2 / 10 and out["slo_e2el_attainment"] == 0.5  # b, c
    assert "goodput_req_s" not in _summary(_calls())        # no SLO, no goodput


def test_percentiles_cost_and_sessions_on_hand_made_calls():
    out = _summary(_calls(), percentiles="50,99.9", gpu_hour_usd=3.0)
    assert out["ttft_p50_s"] == 1.75 and out[percentile_key("ttft", 99.9)] == \
        pytest.approx(np.percentile([2.0, 3.0, 0.5, 1.5], 99.9))
    assert out["tpot_p50_s"] == 0.04                        # NaN left out
    assert out["itl_p50_s"] == 0.025 and out["e2el_p99.9_s"] == pytest.approx(5 + 0.997 * 4)
    cost = 2 * 10 / 3600 * 3.0
    assert out["cost_usd"] == pytest.approx(cost)
    assert out["usd_per_m_tokens"] == pytest.approx(cost / ((5000 + 231) / 1e6))
    assert out["usd_per_m_output_tokens"] == pytest.approx(cost / (231 / 1e6))
    # sessions s (a, b: 0 -> 5), t (2 -> 2.5), u (3 -> 12)
    assert out["sessions_completed"] == 3
    assert out["session_completion_mean_s"] == pytest.approx((5 + 0.5 + 9) / 3)
    assert out["session_completion_p50_s"] == 5.0 and "session_completion_p99.9_s" in out


@pytest.mark.parametrize(("kwargs", "pattern"), [
    (dict(slo="ttft=2,ttlt=3"), r"unknown metric 'ttlt'; allowed: ttft, tpot, e2el"),
    (dict(slo="ttft:2"), r"'ttft:2' is not METRIC=SECONDS"),
    (dict(slo={"tpot": 0}), r"tpot=0 must be a number of seconds > 0"),
    (dict(percentiles="50,101"), r"must be in \[0, 100\]"),
    (dict(gpu_hour_usd=-1.0), r"gpu_hour_usd=-1.0"),
])
def test_bad_options_are_named(kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        metric_options(**kwargs)


def test_goodput_of_a_replay_matches_the_requests_table():
    trace = generate_random_trace(60, input_len=3000, output_len=60, range_ratio=0.5,
                                  request_rate=20.0, burstiness=0.5, seed=3)
    engine = Engine("llama-3.1-8b", "tp2", "h200")
    plain = engine.replay(trace, open_loop=True, warmup_s=0.5)
    calls = plain.requests
    ttft_slo, tpot_slo = calls["ttft_s"].median(), calls["tpot_s"].median()
    result = Engine("llama-3.1-8b", "tp2", "h200").replay(
        trace, open_loop=True, warmup_s=0.5, slo={"ttft": ttft_slo, "tpot": tpot_slo},
        percentiles=(25, 75), gpu_hour_usd=2.0)
    s = result.summary
    good = measured = tokens = 0
    for row in result.requests.itertuples():
        if not (row.completed and row.arrival_s >= 0.5 and row.finish_s <= s["sim_duration_s"]):
            continue
        measured += 1
        tokens += row.input_tokens + row.output_tokens
        tpot = row.tpot_s if row.output_tokens > 1 else 0.0
        good += row.ttft_s <= ttft_slo and tpot <= tpot_slo
    window = s["sim_duration_s"] - 0.5
    assert 0 < good < measured == s["requests_completed"]
    assert s["goodput_req_s"] == pytest.approx(good / window)
    assert s["slo_attainment"] == pytest.approx(good / measured)
    assert s["cost_usd"] == pytest.approx(2 * window / 3600 * 2.0)
    assert s["usd_per_m_tokens"] == pytest.approx(s["cost_usd"] / (tokens / 1e6))
    ttfts = [r.ttft_s for r in result.requests.itertuples() if r.arrival_s >= 0.5]
    assert s["ttft_p25_s"] == pytest.approx(np.percentile(ttfts, 25))
    # the options add keys; they change nothing else
    assert {k: v for k, v in s.items() if k in plain.summary and k not in
            ("wall_s", "sim_speed")} == {k: v for k, v in plain.summary.items()
                                         if k not in ("wall_s", "sim_speed")}


def _naive_sessions(requests: pd.DataFrame, first_call: str) -> list[float]:
    """Completion of each session whose first call (by id) ran and whose calls all finished."""
    times = []
    for _, calls in requests.groupby("session_id"):
        if calls["completed"].all() and calls["request_id"].str.endswith(first_call).any():
            times.append(calls["finish_s"].max() - calls["arrival_s"].min())
    return times


@pytest.mark.parametrize("part_way", [False, True])
def test_session_completion_of_a_closed_loop(part_way):
    trace = generate_multi_turn_trace(12, turns=4, input_len=800, output_len=40,
                                      think_time_s=1.0, seed=2)
    result = Engine("llama-3.1-8b", "tp1", "h200", seed=1).replay(
        trace, concurrency=4, loop_trace=False, start_part_way=part_way)
    times = _naive_sessions(result.requests, ".t000")
    s = result.summary
    assert s["sessions_completed"] == len(times) == (12 if not part_way else len(times))
    if part_way:   # the first sessions started at a later turn: not whole tasks
        assert len(times) < 12
    assert s["session_completion_p50_s"] == pytest.approx(np.percentile(times, 50))
    assert s["session_completion_mean_s"] == pytest.approx(np.mean(times))
    assert math.isfinite(s["session_completion_p90_s"])
