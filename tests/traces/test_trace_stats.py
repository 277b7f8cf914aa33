"""trace_stats on a hand-made trace, checked by counting."""
from __future__ import annotations

import dataclasses
import json

import pytest

from trace_helpers import naive_prefix_reuse, req

from labkit.traces import Trace, trace_stats


def test_counts_and_reuse():
    requests = [
        req("m0", 10, [1, 2, 3], output_length=5),
        req("m1", 20, [1, 2, 4, 5, 6], parent="m0", output_length=3, delay_s=2.0),
        req("a0", 18, [1, 2, 4, 7, 8], parent="m0", kind="subagent", delay_s=1.0),
        req("a1", 25, [1, 2, 4, 7, 9, 10, 11], parent="a0", kind="subagent", delay_s=4.0),
        req("b0", 12, [1, 2, 12], parent="m0", kind="subagent"),
        req("x0", 8, [1, 2], session="x", output_length=7, timestamp=3.0),
        req("y0", 8, [40, 41], session="y", output_length=2, timestamp=1.0),
        req("y1", 12, [40, 41, 42], session="y", parent="y0"),
    ]
    stats = trace_stats(Trace(4, requests, source="hand"))
    json.dumps(stats)  # printable as JSON by the CLI
    assert stats["sessions"] == 3 and stats["requests"] == 8
    assert stats["main_calls"] == 5 and stats["subagent_calls"] == 3
    assert stats["calls_per_session_median"] == 2.0          # [2, 1, 2]
    assert stats["input_tokens_median"] == 12.0
    assert stats["output_tokens_median"] == 1.5                # [1, 1, 1, 1, 2, 3, 5, 7]
    assert stats["subagent_session_share"] == 1 / 3
    assert stats["subagents_per_spawning_session_mean"] == 2.0  # a0 and b0
    assert stats["subagents"] == 2
    assert stats["duration_s"] == 2.0
    assert stats["request_rate"] == (2 - 1) / 2.0   # two timestamped calls over 2 s
    assert stats["total_input_tokens"] == sum(r.input_length for r in requests)
    assert stats["block_size"] == 4 and stats["format"] == "labkit"
    assert stats["prefix_reuse"] == naive_prefix_reuse(requests, 4)
    # By hand: m0's context (15 tokens) has 3 full blocks [1, 2, 4] -- block 2 named
    # by m1. m1 may hit (20-1)//4 = 4 blocks [1, 2, 4, 5]: 5 was partial in m0's
    # context, so 3 hit = 12 tokens. a0 hits [1, 2, 4] = 12 (7 is new). a1 hits
    # [1, 2, 4, 7] = 16. b0 hits [1, 2] = 8. x0 may hit (8-1)//4 = 1 block: 4.
    # y1 hits y0's [40, 41] = 8.
    assert stats["prefix_reuse"] == (12 + 12 + 16 + 8 + 4 + 8) / stats["total_input_tokens"]


def _agentx_like(seed: int):
    from labkit.traces import generate_agentx_trace

    return generate_agentx_trace(5, seed=seed, context_window_tokens=40_000,
                                 compact_threshold_tokens=20_000)


def test_reuse_is_the_naive_one_whatever_the_chunks(monkeypatch):
    """The compiled pass joins contexts a chunk of requests at a time: chunk bounds
    (down to one request per chunk) change nothing."""
    from labkit.traces import stats

    trace = _agentx_like(4)
    expected = naive_prefix_reuse(trace.requests, trace.block_size)
    for chunk in (1 << 22, 300, 1):
        monkeypatch.setattr(stats, "CHUNK_IDS", chunk)
        assert trace_stats(trace)["prefix_reuse"] == pytest.approx(expected, rel=1e-12)


def test_reuse_with_ids_too_sparse_for_a_table():
    """Ids near 2**40 are renamed densely first; the reuse stays the naive one."""
    base = _agentx_like(5)
    shift = (1 << 40) - 1 - base.max_hash_id
    requests = [dataclasses.replace(r, hash_ids=r.hash_ids + shift) for r in base.requests]
    trace = Trace(base.block_size, requests, source="shifted")
    assert trace.max_hash_id == (1 << 40) - 1
    reuse = trace_stats(trace)["prefix_reuse"]
    assert reuse == pytest.approx(naive_prefix_reuse(requests, base.block_size), rel=1e-12)
    assert reuse == trace_stats(base)["prefix_reuse"] > 0.5


def test_request_rate_is_none_without_a_span():
    one = Trace(4, [req("a", 4, [1], timestamp=5.0)])
    closed = Trace(4, [req("a", 4, [1]), req("b", 4, [2], session="t")])
    assert trace_stats(one)["request_rate"] is None
    assert trace_stats(closed)["request_rate"] is None and \
        trace_stats(closed)["duration_s"] is None
