"""Lookups on a hand-made trace: threads, context_ids of generated tokens, forks."""
from __future__ import annotations

import numpy as np
import pytest
from trace_helpers import naive_context, req

from labkit.traces import Trace
from labkit.traces.canonical import is_chain_unique

BS = 4


@pytest.fixture
def trace() -> Trace:
    requests = [
        # m0: 10 tokens = 2 full blocks + 2 tokens; +5 output -> 15 tokens, 4 blocks.
        req("m0", 10, [1, 2, 3], output_length=5),
        # m1 re-sends m0's 15 context tokens (+5): its blocks 2, 3 name m0's output.
        req("m1", 20, [1, 2, 4, 5, 6], parent="m0", output_length=3),
        # a0 forks m0: 15 context tokens + 3 task tokens; block 3 differs from m1's
        # (m0's partial last block is completed by different text).
        req("a0", 18, [1, 2, 4, 7, 8], parent="m0", kind="subagent", output_length=2),
        req("a1", 25, [1, 2, 4, 7, 9, 10, 11], parent="a0", kind="subagent"),
        # b0 forks m0 but departs after one block.
        req("b0", 12, [1, 12, 13], parent="m0", kind="subagent"),
        # c0's prompt is shorter than m0's context but agrees as far as it goes.
        req("c0", 9, [1, 2, 4], parent="m0", kind="subagent"),
        # Session t: the successor is too short to contain t0's whole context.
        req("t0", 8, [20, 21], session="t", output_length=4),
        req("t1", 10, [20, 21, 22], session="t", parent="t0"),
        # Session u: the successor does not re-send u0's prompt.
        req("u0", 8, [30, 31], session="u"),
        req("u1", 12, [30, 32, 33], session="u", parent="u0"),
    ]
    assert is_chain_unique([r.hash_ids for r in requests])
    return Trace(BS, requests)


def ids(trace, rid):
    return trace.context_ids(trace.request(rid)).tolist()


def test_threads(trace):
    r = trace.request
    assert [x.request_id for x in trace.children(r("m0"))] == ["m1", "a0", "b0", "c0"]
    assert trace.successor(r("m0")) is r("m1")
    assert trace.successor(r("a0")) is r("a1")
    assert trace.successor(r("b0")) is None and trace.successor(r("m1")) is None
    assert trace.parent(r("a0")) is r("m0") and trace.parent(r("m0")) is None
    assert [[x.request_id for x in s] for s in trace.sessions()] == [
        ["m0", "m1", "a0", "a1", "b0", "c0"], ["t0", "t1"], ["u0", "u1"]]
    # m1 waits for every subagent forked from m0 (their last calls).
    assert [x.request_id for x in trace.joins(r("m1"))] == ["a1", "b0", "c0"]
    assert trace.joins(r("m0")) == [] and trace.joins(r("t1")) == []
    assert trace.max_hash_id == 33 and len(trace) == 10


def test_context_ids(trace):
    assert ids(trace, "m0") == [1, 2, 4, 5]            # output blocks named by m1
    assert ids(trace, "a0") == [1, 2, 4, 7, 9]         # by a1
    assert ids(trace, "m1") == [1, 2, 4, 5, 6, -1]     # no successor: unknown
    assert ids(trace, "t0") == [20, 21, -1]            # successor too short
    assert ids(trace, "u0") == [30, 31, -1]            # successor disagrees
    for r in trace.requests:
        ctx = trace.context_ids(r)
        assert ctx.dtype == np.int64
        assert len(ctx) == -(-(r.input_length + r.output_length) // BS)
        assert ctx.tolist() == naive_context(trace.requests, r, BS)
    # all known: the successor's own ids, shared (a replay keeps one per call), read-only
    m0, m1 = trace.request("m0"), trace.request("m1")
    ctx = trace.context_ids(m0)
    assert np.shares_memory(ctx, m1.hash_ids) and not ctx.flags.writeable
    assert not np.shares_memory(trace.context_ids(m1), m1.hash_ids)  # -1s appended: a copy


def test_fork_tokens(trace):
    def f(rid: str) -> int:
        return trace.fork_tokens(trace.request(rid))

    assert f("a0") == 10 + 5          # all of m0's full context blocks agree
    assert f("b0") == 1 * BS          # agrees on one leading block
    assert f("c0") == 9               # agrees, but the prompt is only 9 tokens
    assert f("a1") == 0 and f("m1") == 0 and f("m0") == 0


def test_context_shared_tokens_as_the_ids_say(trace):
    """Every call's tokens re-sending its parent's context, against the parent's context
    ids made naively: leading blocks that agree (an unknown id agrees with nothing), the
    whole context where all its full blocks do. Both ways of knowing the parent's ids
    are met: m1 and a1 are their parents' successors (the ids they re-send are their
    own), a0, b0, c0 fork m0 and t1, u1 do not re-send their parents' contexts."""
    def naive(r) -> int:
        parent = trace.parent(r)
        if parent is None:
            return 0
        ctx_tokens = parent.input_length + parent.output_length
        n_full = ctx_tokens // BS
        ctx = naive_context(trace.requests, parent, BS)
        agree = 0
        while agree < min(n_full, len(r.hash_ids)) and ctx[agree] == r.hash_ids[agree] >= 0:
            agree += 1
        return min(ctx_tokens if agree == n_full else agree * BS, r.input_length)

    shared = {r.request_id: trace.context_shared_tokens(r) for r in trace.requests}
    assert shared == {r.request_id: naive(r) for r in trace.requests}
    assert shared["m1"] == 15 and shared["a1"] == 20 and shared["u1"] == BS
    assert shared["t1"] == 8  # t0's prompt re-sent; its output's block unknown


def test_a_trace_whose_arrays_are_read_only_answers_the_same(trace):
    """Ray hands its workers a trace's arrays zero-copy, read-only (pickle protocol 5,
    out-of-band buffers): the lookups write nothing into them."""
    import pickle

    buffers = []
    data = pickle.dumps(trace, protocol=5, buffer_callback=buffers.append)
    frozen = pickle.loads(data, buffers=[b.raw().toreadonly() for b in buffers])
    assert not frozen.requests[0].hash_ids.flags.writeable
    for r, f in zip(trace.requests, frozen.requests):
        assert frozen.context_ids(f).tolist() == trace.context_ids(r).tolist()
        assert frozen.context_shared_tokens(f) == trace.context_shared_tokens(r)
        assert frozen.fork_tokens(f) == trace.fork_tokens(r)
