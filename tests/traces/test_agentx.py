"""The AgentX-like generator: deterministic, well-formed, and on the published figures."""
from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from trace_helpers import naive_prefix_reuse

from labkit.errors import ConfigError
from labkit.traces import AgentXParams, generate_agentx_trace, load_trace, schema, trace_stats

# SemiAnalysis AgentX (Claude Code traces), see DESIGN.md section 1.
CALLS_MEDIAN, INPUT_MEDIAN, OUTPUT_MEDIAN = 43, 142_000, 444
SPAWN_SHARE, SUBAGENTS_MEAN = 0.44, 4.0


def measure(trace) -> dict:
    """The headline figures, counted directly from the requests."""
    main_calls = Counter(r.session_id for r in trace.requests if r.kind == "main")
    by_id = {r.request_id: r for r in trace.requests}
    forks = Counter(r.session_id for r in trace.requests
                    if r.kind == "subagent" and by_id[r.parent_id].kind == "main")
    return {
        "calls": float(np.median(list(main_calls.values()))),
        "input": float(np.median([r.input_length for r in trace.requests])),
        "output": float(np.median([r.output_length for r in trace.requests])),
        "share": len(forks) / len(main_calls),
        "subagents": sum(forks.values()) / len(forks),
        "reuse": trace_stats(trace)["prefix_reuse"],
    }


@pytest.fixture(scope="module", params=[0, 1, 2])
def calibration(request) -> dict:
    return measure(generate_agentx_trace(200, seed=request.param))


def test_lands_on_published_figures(calibration):
    m = calibration
    assert abs(m["calls"] / CALLS_MEDIAN - 1) <= 0.10, m
    assert abs(m["input"] / INPUT_MEDIAN - 1) <= 0.10, m
    assert abs(m["output"] / OUTPUT_MEDIAN - 1) <= 0.10, m
    assert m["reuse"] >= 0.96, m
    assert abs(m["share"] - SPAWN_SHARE) <= 0.05, m
    assert abs(m["subagents"] - SUBAGENTS_MEAN) <= 0.2 * SUBAGENTS_MEAN, m


def test_deterministic():
    a, b = generate_agentx_trace(12, seed=5), generate_agentx_trace(12, seed=5)
    assert a.requests == b.requests and a.source == b.source
    c = generate_agentx_trace(12, seed=6)
    assert [r.input_length for r in c.requests] != [r.input_length for r in a.requests]


def test_one_draw_on_numbers_is_the_array_draw():
    """The session builder draws its token counts one at a time on numbers; each is
    the one `lognormal_tokens` draws as a (1,) array from the same stream: the same
    normal, rounding and clipping (`lo` 1, `hi` reached as well as not)."""
    from labkit.traces.agentx_session import SessionBuilder, lognormal_tokens

    builder = SessionBuilder(AgentXParams(), 64, None, None, [])
    builder.rng, reference = np.random.default_rng(3), np.random.default_rng(3)
    cases = [(142_000.0, 1.2, 2**31), (444.0, 0.9, 4096), (2.0, 3.0, 2**31), (50.0, 2.5, 60)]
    drawn, expected = [], []
    for i in range(4000):
        median, sigma, hi = cases[i % len(cases)]
        drawn.append(builder._tokens(median, sigma, hi))
        expected.append(int(lognormal_tokens(reference, median, sigma, 1, 1, hi)[0]))
    assert drawn == expected and {1, 60} <= set(drawn)  # both bounds met
    assert builder.rng.random() == reference.random()  # the stream at the same place


def test_knobs():
    trace = generate_agentx_trace(10, seed=1, subagent_session_share=0.0, block_size=32)
    assert trace.block_size == 32 and all(r.kind == "main" for r in trace.requests)
    assert "subagent_session_share=0.0" in trace.source
    with pytest.raises(TypeError):
        generate_agentx_trace(2, colour="red")
    with pytest.raises(ValueError):
        AgentXParams(subagent_session_share=1.5)


@pytest.fixture(scope="module")
def trace():
    return generate_agentx_trace(40, seed=7)


def test_chain_unique_by_construction(monkeypatch):
    results = []
    real = schema.canonicalize

    def spy(hash_lists, top=None):
        results.append(real(hash_lists, top))
        return results[-1]

    monkeypatch.setattr(schema, "canonicalize", spy)
    generate_agentx_trace(10, seed=3)
    assert results == [None]  # nothing had to be re-numbered


def test_requests_own_their_ids(trace):
    arrays = [r.hash_ids for r in trace.requests]
    assert all(a.flags.owndata for a in arrays)
    assert not any(np.shares_memory(x, y) for x, y in itertools.pairwise(arrays))


def test_sessions_share_the_system_prompt_and_start_idle(trace):
    shared = AgentXParams().shared_prefix_tokens // trace.block_size
    firsts = [s[0] for s in trace.sessions()]
    assert all(f.parent_id is None and f.delay_s == 0.0 for f in firsts)
    prefix = firsts[0].hash_ids[:shared]
    assert all(np.array_equal(f.hash_ids[:shared], prefix) for f in firsts)
    # ... and nothing after it: the next block is each session's own.
    assert len({int(f.hash_ids[shared]) for f in firsts}) == len(firsts)
    delays = np.array([r.delay_s for r in trace.requests if r.parent_id is not None])
    assert delays.min() > 0 and delays.max() <= AgentXParams().max_delay_s
    assert 1 < np.median(delays) < 30 and np.percentile(delays, 99) > 30  # heavy tail


def test_prompts_grow_by_appending(trace):
    """Turn k+1's prompt = turn k's prompt + output + more: its ids re-send all of
    turn k's full context blocks (main and subagent threads alike)."""
    bs = trace.block_size
    pairs = [(r, trace.successor(r)) for r in trace.requests if trace.successor(r)]
    assert len(pairs) > 0.9 * len(trace)
    for r, nxt in pairs:
        assert nxt.input_length > r.input_length + r.output_length
        ctx = trace.context_ids(r)
        assert (ctx >= 0).all()
        n_full = (r.input_length + r.output_length) // bs
        assert np.array_equal(nxt.hash_ids[:n_full], ctx[:n_full])


def test_compaction_restarts_from_the_shared_prefix():
    p = AgentXParams(context_window_tokens=200_000, compact_threshold_tokens=150_000)
    trace = generate_agentx_trace(20, seed=4, context_window_tokens=p.context_window_tokens,
                                  compact_threshold_tokens=p.compact_threshold_tokens)
    shared = p.shared_prefix_tokens // trace.block_size
    prefix = trace.requests[0].hash_ids[:shared]
    compactions = 0
    for r in trace.requests:
        assert r.input_length + p.output_max <= p.context_window_tokens + \
            p.compact_instruction_tokens
        nxt = trace.successor(r)
        if r.kind == "main" and nxt is not None and nxt.input_length < r.input_length:
            compactions += 1
            assert r.input_length > p.compact_threshold_tokens
            assert np.array_equal(nxt.hash_ids[:shared], prefix)
            assert nxt.hash_ids[shared] not in set(r.hash_ids.tolist())  # fresh content
            assert (trace.context_ids(r)[r.input_length // trace.block_size:] == -1).all()
    assert compactions > 0


def test_subagents_fork_the_parent_context(trace):
    forks = [r for r in trace.requests if r.kind == "subagent" and trace.parent(r).kind == "main"]
    assert forks
    bs = trace.block_size
    for r in forks:
        parent = trace.parent(r)
        n_full = (parent.input_length + parent.output_length) // bs
        assert np.array_equal(r.hash_ids[:n_full], trace.context_ids(parent)[:n_full])
        assert trace.fork_tokens(r) == parent.input_length + parent.output_length
        assert r.input_length > parent.input_length + parent.output_length  # + task


def test_subagent_results_precede_the_next_main_call(trace):
    position = {r.request_id: i for i, r in enumerate(trace.requests)}
    spawned = defaultdict(list)
    for r in trace.requests:
        if r.kind == "subagent" and trace.parent(r).kind == "main":
            spawned[r.parent_id].append(r)
    assert any(len(v) > 1 for v in spawned.values())  # some run in parallel
    for parent_id, firsts in spawned.items():
        nxt = trace.successor(trace.request(parent_id))
        assert nxt is not None, "every spawning call has a next main call"
        lasts = []
        for call in firsts:
            while True:
                assert position[call.request_id] < position[nxt.request_id]
                if trace.successor(call) is None:
                    break
                call = trace.successor(call)
            lasts.append(call)
        assert trace.joins(nxt) == lasts
        parent = trace.request(parent_id)
        reports = sum(x.output_length for x in lasts)
        assert nxt.input_length >= parent.input_length + parent.output_length + reports


def test_prefix_reuse_matches_reference_on_generated_trace():
    small = generate_agentx_trace(3, seed=11, block_size=512)
    assert trace_stats(small)["prefix_reuse"] == naive_prefix_reuse(small.requests, 512)


def test_shipped_small_trace_matches_its_recipe():
    """data/traces/agentx_small.jsonl.gz is what its README says generated it. Times
    agree to the last bits only: numpy's vectorised exp and log may round the last
    bit differently on another CPU (AVX-512 or AVX2 paths), so they agree to 1e-12."""
    repo_root = Path(__file__).resolve().parents[2]
    shipped = load_trace(repo_root / "data" / "traces" / "agentx_small.jsonl.gz").requests
    made = generate_agentx_trace(6, seed=0, block_size=64).requests
    assert len(shipped) == len(made)
    for a, b in zip(shipped, made):
        assert a.delay_s == pytest.approx(b.delay_s, rel=1e-12, abs=1e-12)
        assert (a.timestamp is None) == (b.timestamp is None)
        if a.timestamp is not None:
            assert a.timestamp == pytest.approx(b.timestamp, rel=1e-12)
        assert replace(a, delay_s=0.0, timestamp=None) == replace(b, delay_s=0.0,
                                                                  timestamp=None)


@pytest.mark.parametrize(("knobs", "pattern"), [
    (dict(shared_prefix_tokens=1e300), r"shared_prefix_tokens=1e\+300 must be <= 134217728"),
    (dict(output_median="x"), r"output_median='x' must be a number"),
    (dict(output_sigma=64.0), r"output_sigma=64.0 must be <= 10.0"),  # (exp overflowed)
])
def test_knobs_past_any_prompt_are_named(knobs, pattern):
    """(1e300 shared tokens were a ValueError from numpy, minting the ids.)"""
    with pytest.raises(ConfigError, match=pattern):
        generate_agentx_trace(1, **knobs)
    with pytest.raises(ConfigError, match=r"num_sessions=10,000,000 must be <= 1,000,000"):
        generate_agentx_trace(10**7)
