"""Benchmark loads against the distributions they claim: gamma arrivals (vLLM's
--request-rate / --burstiness), integer-uniform lengths (--range-ratio), and the
prefix structure of shared-prefix and multi-turn loads. Tolerances are 4 standard
errors of the statistic at the sample size used (seeds are fixed, so each test is
deterministic; a wrong distribution misses by many standard errors)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from trace_helpers import naive_prefix_reuse

from labkit.cli import main
from labkit.errors import ConfigError
from labkit.traces import (
    generate_multi_turn_trace, generate_random_trace, generate_shared_prefix_trace, load_trace,
    trace_stats)
from labkit.traces.arrivals import arrival_times


def _gaps(times: np.ndarray) -> np.ndarray:
    return np.diff(np.concatenate([[0.0], times]))   # the first request waits a gap too


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_gamma_arrivals_rate_and_shape(burstiness):
    n, rate = 20_000, 5.0
    times = arrival_times(n, rate, burstiness, np.random.default_rng(7))
    assert np.all(np.diff(times) >= 0)
    assert times[-1] == pytest.approx(n / rate, rel=1e-12)   # rescaled: exact mean rate
    x = _gaps(times) * rate                                  # ~ Gamma(B, 1/B): mean 1
    var = 1 / burstiness
    # Var(sample variance) ~ sigma^4 (2 + 6/B) / n for a gamma (excess kurtosis 6/B).
    assert x.var() == pytest.approx(var, abs=4 * var * math.sqrt((2 + 6 / burstiness) / n))


def test_poisson_arrivals_are_exponential_and_counts_poisson():
    n, rate = 20_000, 5.0
    times = arrival_times(n, rate, 1.0, np.random.default_rng(3))
    x = np.sort(_gaps(times) * rate)
    ks = np.max(np.abs(np.arange(1, n + 1) / n - (1 - np.exp(-x))))
    assert ks < 1.63 / math.sqrt(n)                          # Kolmogorov-Smirnov, alpha 1%
    counts = np.bincount(times.astype(int))[:-1]             # per whole second
    dispersion = counts.var() / counts.mean()                # 1 for a Poisson process
    assert dispersion == pytest.approx(1.0, abs=4 * math.sqrt(2 / len(counts)))


def test_gaps_below_the_smallest_float_are_all_at_once():
    rng = np.random.default_rng(0)
    assert np.array_equal(arrival_times(5, 1e300, 1e300, rng), np.zeros(5))  # (was NaN)


def test_arrival_limits_and_seeds():
    assert np.array_equal(arrival_times(4, math.inf, 1.0, np.random.default_rng(0)),
                          np.zeros(4))
    assert np.allclose(arrival_times(4, 2.0, math.inf, np.random.default_rng(0)),
                       [0.5, 1.0, 1.5, 2.0])
    a = arrival_times(50, 2.0, 1.0, np.random.default_rng(1))
    assert np.array_equal(a, arrival_times(50, 2.0, 1.0, np.random.default_rng(1)))
    assert not np.array_equal(a, arrival_times(50, 2.0, 1.0, np.random.default_rng(2)))
    for bad in [dict(request_rate=0.0), dict(burstiness=0.0)]:
        with pytest.raises(ConfigError, match=next(iter(bad))):
            arrival_times(3, **{"request_rate": 1.0, "burstiness": 1.0, **bad},
                          rng=np.random.default_rng(0))


def _check_uniform(values: np.ndarray, low: int, high: int) -> None:
    """Integer-uniform on [low, high]: bounds reached, mean and variance within 4 SE."""
    n = len(values)
    assert values.min() == low and values.max() == high
    mean, var = (low + high) / 2, ((high - low + 1) ** 2 - 1) / 12
    assert values.mean() == pytest.approx(mean, abs=4 * math.sqrt(var / n))
    # Var(sample variance) = (mu4 - var^2) / n, mu4 of a discrete uniform ~ 9/5 var^2
    assert values.var() == pytest.approx(var, abs=4 * var * math.sqrt(0.8 / n))


def test_random_load_lengths_prefix_and_rate():
    n = 4000
    trace = generate_random_trace(n, input_len=1000, output_len=100, range_ratio=0.25,
                                  prefix_len=130, request_rate=8.0, seed=5, block_size=64)
    inputs = np.array([r.input_length for r in trace.requests]) - 130
    outputs = np.array([r.output_length for r in trace.requests])
    _check_uniform(inputs, 750, 1250)        # floor(1000 * 0.75), ceil(1000 * 1.25)
    _check_uniform(outputs, 75, 125)
    stamps = np.array([r.timestamp for r in trace.requests])
    assert stamps[-1] == pytest.approx(n / 8.0) and np.all(np.diff(stamps) >= 0)
    # The 130-token prefix is two full blocks every prompt shares, then its own ids.
    heads = {tuple(r.hash_ids[:2]) for r in trace.requests}
    thirds = [r.hash_ids[2] for r in trace.requests]
    assert len(heads) == 1 and len(set(thirds)) == n
    reuse = trace_stats(trace)["prefix_reuse"]
    assert reuse == pytest.approx(128 * (n - 1) / (inputs.sum() + 130 * n), rel=1e-12)


def test_random_load_is_vllm_default_and_fixed_lengths():
    trace = generate_random_trace(10)
    assert {(r.input_length, r.output_length) for r in trace.requests} == {(1024, 128)}
    assert {r.timestamp for r in trace.requests} == {0.0}     # request_rate inf
    assert trace_stats(trace)["prefix_reuse"] == 0.0


def test_shared_prefix_groups_shuffled():
    groups, per = 8, 50
    trace = generate_shared_prefix_trace(groups, per, system_prompt_len=256,
                                         question_len=100, output_len=20, request_rate=4.0,
                                         seed=2, block_size=64)
    assert len(trace) == groups * per
    assert {r.input_length for r in trace.requests} == {356}
    by_group: dict[str, set] = {}
    for r in trace.requests:
        by_group.setdefault(r.session_id.split(".")[0], set()).add(tuple(r.hash_ids[:4]))
    assert len(by_group) == groups and all(len(s) == 1 for s in by_group.values())
    assert len({next(iter(s)) for s in by_group.values()}) == groups
    first = [r.session_id.split(".")[0] for r in trace.requests[:per]]
    assert len(set(first)) > 1                                # interleaved, not in blocks
    # Every prompt but each group's first hits its 256-token system prompt.
    expected = groups * (per - 1) * 256 / (groups * per * 356)
    reuse = trace_stats(trace)["prefix_reuse"]
    assert reuse == pytest.approx(expected, rel=1e-12)
    assert reuse == pytest.approx(naive_prefix_reuse(trace.requests, 64), rel=1e-12)


def test_multi_turn_sessions_grow_and_reuse():
    trace = generate_multi_turn_trace(3, turns=3, input_len=64, output_len=64,
                                      block_size=64)
    # By hand: prompts 64, 192, 320 tokens; turn 2 hits 2 blocks, turn 3 hits 4.
    assert [r.input_length for r in trace.requests[:3]] == [64, 192, 320]
    assert trace_stats(trace)["prefix_reuse"] == (128 + 256) / (64 + 192 + 320)


def test_multi_turn_distributions():
    sessions = 3000
    trace = generate_multi_turn_trace(sessions, turns=6, system_prompt_len=100,
                                      input_len=50, output_len=30, range_ratio=0.5,
                                      think_time_s=2.0, request_rate=10.0, seed=4,
                                      block_size=16)
    grouped = trace.sessions()
    _check_uniform(np.array([len(s) for s in grouped]), 3, 9)
    firsts = np.array([s[0].timestamp for s in grouped])
    assert firsts[-1] == pytest.approx(sessions / 10.0)
    assert all(r.timestamp is None for s in grouped for r in s[1:])
    thinks = np.array([r.delay_s for s in grouped for r in s[1:]])
    # exponential: sd = mean
    assert thinks.mean() == pytest.approx(2.0, abs=4 * 2.0 / math.sqrt(len(thinks)))
    asks = []
    for s in grouped:
        assert s[0].input_length - 100 in range(25, 76)
        for before, after in zip(s, s[1:], strict=False):
            assert after.parent_id == before.request_id
            ask = after.input_length - before.input_length - before.output_length
            asks.append(ask)
            full = before.input_length // 16   # the history's full blocks are re-sent
            assert np.array_equal(after.hash_ids[:full], before.hash_ids[:full])
    _check_uniform(np.array(asks), 25, 75)
    _check_uniform(np.array([r.output_length for r in trace.requests]), 15, 45)


@pytest.mark.parametrize(("make", "knobs", "pattern"), [
    (generate_random_trace, dict(num_prompts=0), r"num_prompts=0 must be an integer >= 1"),
    (generate_random_trace, dict(range_ratio=1.0), r"range_ratio=1.0 must be in \[0, 1\)"),
    (generate_random_trace, dict(input_len=1, range_ratio=0.5), r"allows empty prompts"),
    (generate_shared_prefix_trace, dict(question_len=-1), r"question_len=-1 must be"),
    (generate_multi_turn_trace, dict(think_time_s=-1.0), r"think_time_s=-1.0"),
    (generate_multi_turn_trace, dict(burstiness=0.0, request_rate=1.0), r"burstiness=0.0"),
    # wrong types and sizes (were TypeErrors and MemoryErrors from the Python API)
    (generate_random_trace, dict(burstiness="x"), r"burstiness='x' must be a number > 0"),
    (generate_random_trace, dict(range_ratio=None), r"range_ratio=None must be in \[0, 1\)"),
    (generate_multi_turn_trace, dict(think_time_s="x"), r"think_time_s='x' must be a number"),
    (generate_random_trace, dict(input_len=2.5), r"input_len=2.5 must be an integer >= 0"),
    (generate_random_trace, dict(seed=-1), r"seed=-1 must be an integer >= 0"),
    (generate_random_trace, dict(num_prompts=True), r"num_prompts=True must be an integer"),
    (generate_random_trace, dict(prefix_len=10**12), r"prefix_len=1000000000000 must be an "
                                                     r"integer >= 0 and <= 134,217,728"),
    (generate_shared_prefix_trace, dict(num_groups=10**4, prompts_per_group=10**4),
     r"this load holds up to 100,000,000 calls; at most 10,000,000"),
    (generate_random_trace, dict(num_prompts=10**6, input_len=10**6),
     r"this load's prompts hold up to 15,625,000,000 block ids \(116 GiB\)"),
    (generate_multi_turn_trace, dict(num_sessions=1000, turns=500, input_len=5000),
     r"block ids"),  # each turn re-sends the conversation: quadratic in turns
])
def test_bad_knobs_are_named(make, knobs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        make(**knobs)


def test_cli_generates_each_kind(tmp_path, capsys):
    out = tmp_path / "sp.jsonl"
    assert main(["trace", "gen", "--kind", "shared-prefix", "--num-groups", "2",
                 "--prompts-per-group", "3", "--system-prompt-len", "64", "--question-len",
                 "10", "--request-rate", "2", "--burstiness", "0.5", "--seed", "1",
                 "--out", str(out)]) == 0
    trace = load_trace(out)
    assert len(trace) == 6 and trace.requests[-1].timestamp == pytest.approx(3.0)
    assert trace.requests == generate_shared_prefix_trace(
        2, 3, system_prompt_len=64, question_len=10, request_rate=2.0, burstiness=0.5,
        seed=1).requests
    out = tmp_path / "mt.jsonl"
    assert main(["trace", "gen", "--kind", "multi-turn", "--sessions", "4", "--turns", "2",
                 "--out", str(out)]) == 0
    assert len(load_trace(out).sessions()) == 4
    capsys.readouterr()
    assert main(["trace", "gen", "--kind", "random", "--turns", "3", "--out",
                 str(tmp_path / "x.jsonl")]) == 2
    assert "--turns is not a knob of --kind random (it is of multi-turn)" in \
        capsys.readouterr().err
    assert main(["trace", "gen", "--kind", "agentx", "--sessions", "2", "--num-prompts", "3",
                 "--out", str(tmp_path / "x.jsonl")]) == 2
    assert not (tmp_path / "x.jsonl").exists()
