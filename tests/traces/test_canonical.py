"""Chain-unique ids: repeated ids at different positions / after different
predecessors are re-numbered, and prefix reuse matches a chain-keyed reference."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from trace_helpers import naive_prefix_reuse, req

from labkit.traces import Trace, TraceRequest
from labkit.traces.canonical import canonicalize, is_chain_unique
from labkit.traces.stats import prefix_reuse


def chains(hash_lists) -> list[tuple]:
    """Every (request, position) entry's full chain of raw ids."""
    return [tuple(int(x) for x in h[:j + 1]) for h in hash_lists for j in range(len(h))]


def assert_canonical_form(raw, canon):
    assert is_chain_unique(canon)
    flat_raw, flat_new = chains(raw), [int(x) for h in canon for x in h]
    # Same chain <=> same new id.
    pairs = set(zip(flat_raw, flat_new, strict=True))
    assert len(pairs) == len(set(flat_raw)) == len(set(flat_new))


def test_repeated_ids_are_remapped():
    raw = [np.array([1, 2, 3]), np.array([2, 3]), np.array([1, 2, 9]), np.array([4, 2])]
    assert not is_chain_unique(raw)
    canon = canonicalize(raw)
    assert_canonical_form(raw, canon)
    # The first chain to use a raw id keeps it; later, different chains get new
    # ids above the largest raw id, in order of first appearance.
    assert canon[0].tolist() == [1, 2, 3]
    assert canon[2].tolist() == [1, 2, 9]
    assert canon[1].tolist() == [10, 11]
    assert canon[3].tolist() == [4, 12]


def test_canonical_input_is_left_alone():
    raw = [np.array([5, 6, 7]), np.array([5, 6, 8]), np.array([9])]
    assert is_chain_unique(raw) and canonicalize(raw) is None
    trace = Trace(2, [req("a", 5, raw[0]), req("b", 6, raw[1], session="t"),
                      req("c", 1, raw[2], session="u")])
    assert trace.requests[0].hash_ids is raw[0]


def test_sparse_ids_near_the_limit():
    big = 2**40 - 5
    raw = [np.array([big, 3]), np.array([3, big])]
    canon = canonicalize(raw)
    assert_canonical_form(raw, canon)
    assert max(int(h.max()) for h in canon) < 2**40   # no room above: renumbered densely


@st.composite
def random_traces(draw):
    """Small traces with heavy id collisions, threads and subagents; successors
    often re-send their parent's ids so that context_ids has something to find."""
    bs = draw(st.integers(1, 4))
    offset = draw(st.sampled_from([0, 2**39]))         # exercise the sparse-id paths
    alphabet = st.integers(0, 4).map(lambda x: x + offset)
    requests: list[TraceRequest] = []
    last_main: dict[str, str] = {}                     # session -> last main call
    for i in range(draw(st.integers(1, 12))):
        choice = draw(st.integers(0, 2)) if requests else 0
        out = draw(st.integers(1, 6))
        parent = None
        kind, session = "main", f"s{i}"
        if choice == 1:                                 # next main call of a session
            session = draw(st.sampled_from(sorted(last_main)))
            parent = last_main[session]
        elif choice == 2:                               # fork or continue a subagent
            parent_req = draw(st.sampled_from(requests))
            taken = {r.parent_id for r in requests if r.kind == "subagent"}
            if parent_req.kind == "subagent" and parent_req.request_id in taken:
                parent_req = next(r for r in requests if r.session_id == parent_req.session_id
                                  and r.kind == "main")
            parent, kind, session = parent_req.request_id, "subagent", parent_req.session_id
        length = draw(st.integers(1, 14))
        ids = draw(st.lists(alphabet, min_size=-(-length // bs), max_size=-(-length // bs)))
        if parent is not None and draw(st.booleans()):  # re-send the parent's context
            p = next(r for r in requests if r.request_id == parent)
            length = max(length, p.input_length + p.output_length + draw(st.integers(0, 3)))
            n = -(-length // bs)
            ids = list(p.hash_ids[:p.input_length // bs]) + draw(
                st.lists(alphabet, min_size=n, max_size=n))
            ids = ids[:n]
        requests.append(req(f"r{i}", length, ids, session=session, parent=parent,
                            kind=kind, output_length=out))
        if kind == "main":
            last_main[session] = f"r{i}"
    return bs, requests


@settings(max_examples=300, deadline=None)
@given(random_traces())
def test_prefix_reuse_matches_chain_keyed_reference(case):
    bs, requests = case
    raw = [TraceRequest(r.session_id, r.request_id, r.parent_id, r.kind, r.delay_s,
                        r.input_length, r.output_length, r.hash_ids.copy())
           for r in requests]
    trace = Trace(bs, requests)             # canonicalises (may replace hash_ids)
    assert_canonical_form([r.hash_ids for r in raw], [r.hash_ids for r in trace.requests])
    assert prefix_reuse(trace) == naive_prefix_reuse(raw, bs)


def _naive_chain_unique(hash_lists) -> bool:
    """The definition: every id seen at one block position, after one predecessor."""
    seen = {}
    for h in hash_lists:
        for j, x in enumerate(h.tolist()):
            if seen.setdefault(x, (j, h[j - 1] if j else -1)) != (j, h[j - 1] if j else -1):
                return False
    return True


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(0, 6), max_size=6), max_size=8),
       st.sampled_from([0, 2**39]), st.sampled_from([1, 3, 1 << 22]), st.sampled_from([0, 256]))
def test_the_check_agrees_with_its_definition_part_by_part(lists, offset, chunk, long_lists):
    """Lists joined 1, 3 or all at a time (`CHECK_CHUNK`), or read one by one where they
    lie (`LONG_LISTS` 0: whatever their lengths): the check and the ids' range are the
    same."""
    from labkit.traces import canonical

    hash_lists = [np.array(h, dtype=np.int64) + offset for h in lists]
    saved = canonical.CHECK_CHUNK, canonical.LONG_LISTS
    canonical.CHECK_CHUNK, canonical.LONG_LISTS = chunk, long_lists
    try:
        assert is_chain_unique(hash_lists) == _naive_chain_unique(hash_lists)
        flat = [x for h in lists for x in h]
        assert canonical.id_range(hash_lists) == \
            ((min(flat) + offset, max(flat) + offset) if flat else (0, -1))
    finally:
        canonical.CHECK_CHUNK, canonical.LONG_LISTS = saved


def test_long_lists_are_read_where_they_lie():
    """An agentic trace's contexts (thousands of ids each) are checked list by list,
    never joined: a repeat deep inside one list is still found."""
    from labkit.traces import canonical

    long = [np.arange(1000, dtype=np.int64), np.arange(1000, 1600, dtype=np.int64)]
    parts = list(canonical._parts(long, canonical._lengths(long)))
    assert [ids is h for (ids, _), h in zip(parts, long)] == [True, True]
    assert is_chain_unique(long) and canonical.id_range(long) == (0, 1599)
    bad = [long[0], np.concatenate([long[1][:300], [5], long[1][300:]])]  # 5 at position 300
    assert not is_chain_unique(bad)


def test_negative_ids_are_refused():
    import pytest

    with pytest.raises(ValueError, match=">= 0"):
        is_chain_unique([np.array([3, -1])])
