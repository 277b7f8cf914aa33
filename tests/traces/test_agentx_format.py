"""AgentX / Weka-style trace objects: main calls, subagents, joins, delays and id scopes,
from fixture files written after the published format (kv-cache-tester's
trace_replay_tester.md and the aiperf loader's schema)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from trace_helpers import naive_prefix_reuse, req

from labkit.traces import TraceError, load_trace, trace_stats

FIXTURES = Path(__file__).parent / "fixtures"


def test_one_conversation_with_parallel_subagents():
    trace = load_trace(FIXTURES / "agentx.json")     # one object over many lines
    assert (trace.format, trace.block_size) == ("agentx", 4)
    rows = [(r.request_id, r.parent_id, r.kind, r.input_length, r.output_length)
            for r in trace.requests]
    assert rows == [
        ("conv-a.m000", None, "main", 10, 3),
        ("conv-a.m001", "conv-a.m000", "main", 16, 2),
        ("conv-a.sa00.000", "conv-a.m001", "subagent", 12, 4),
        ("conv-a.sa00.001", "conv-a.sa00.000", "subagent", 20, 4),
        ("conv-a.sa01.000", "conv-a.m001", "subagent", 8, 2),
        ("conv-a.m002", "conv-a.m001", "main", 30, 5),
    ]
    assert {r.session_id for r in trace.requests} == {"conv-a"}
    assert all(r.timestamp is None for r in trace.requests)      # closed loop only
    # The main call after the subagents waits for the last call of each of them.
    last = trace.request("conv-a.m002")
    assert [j.request_id for j in trace.joins(last)] == ["conv-a.sa00.001", "conv-a.sa01.000"]
    # delay_s: think_time when recorded, else t - end of what the call waits for:
    # m001 5 - (0 + 2); sa00.000 6.5 - (5 + 1); sa00.001 think 1.25; sa01.000 has a
    # relative t: 6.6 + 0.2 - 6; m002 20 - max(6, 10 + 2, 6.5 + 9000 ms, 6.8 + 0.3).
    assert [r.delay_s for r in trace.requests] == pytest.approx(
        [0.0, 3.0, 0.5, 1.25, 0.8, 4.5])
    raw = [req("conv-a.m000", 10, [100, 101, 102], output_length=3),
           req("conv-a.m001", 16, [100, 101, 103, 104], parent="conv-a.m000", output_length=2),
           req("conv-a.sa00.000", 12, [100, 101, 200], parent="conv-a.m001", kind="subagent",
               output_length=4),
           req("conv-a.sa00.001", 20, [100, 101, 200, 201, 202], parent="conv-a.sa00.000",
               kind="subagent", output_length=4),
           req("conv-a.sa01.000", 8, [100, 101], parent="conv-a.m001", kind="subagent",
               output_length=2),
           req("conv-a.m002", 30, [100, 101, 103, 104, 105, 106, 107, 108],
               parent="conv-a.m001", output_length=5)]
    reuse = trace_stats(trace)["prefix_reuse"]
    assert reuse == naive_prefix_reuse(raw, 4)
    # By hand: m000's context (13 tokens) is [100, 101, 103] (its third block named by
    # m001), all hit by m001 (12); sa00.000 hits [100, 101] (8); sa00.001 hits
    # sa00.000's context [100, 101, 200, 201] (16); sa01.000 may hit (8-1)//4 = 1
    # block (4); m002 hits m001's context [100, 101, 103, 104] (16).
    assert reuse == (12 + 8 + 16 + 4 + 16) / (10 + 16 + 12 + 20 + 8 + 30)
    assert trace_stats(trace)["subagents"] == 2


def test_many_objects_scopes_and_missing_ids():
    trace = load_trace(FIXTURES / "agentx_many.jsonl")          # one object per line
    rows = [(r.request_id, r.session_id, r.parent_id, r.kind, r.output_length)
            for r in trace.requests]
    assert rows == [
        ("conv-b.m000", "conv-b", None, "main", 1),
        ("conv-b.m001", "conv-b", "conv-b.m000", "main", 1),
        ("conv-c.sa00.000", "conv-c.sa00", None, "main", 1),  # a subagent before any call
        ("conv-c.m000", "conv-c", None, "main", 1),           # out 0 -> 1
        ("conv-g1.m000", "conv-g1", None, "main", 1),
        ("conv-g2.m000", "conv-g2", None, "main", 1),
    ]
    assert trace.request("conv-b.m001").delay_s == 3.0        # no api_time: t gap
    # "local" ids of different objects never meet; "global" ones do; conv-b.m001 has
    # no hash_ids: fresh ones.
    raw = [req("conv-b.m000", 8, [100, 101], session="b"),
           req("conv-b.m001", 9, [9001, 9002, 9003], session="b", parent="conv-b.m000"),
           req("conv-c.sa00.000", 4, [1100], session="csa"),
           req("conv-c.m000", 4, [1100], session="c"),
           req("conv-g1.m000", 12, [5, 6, 7], session="g1"),
           req("conv-g2.m000", 12, [5, 6, 8], session="g2")]
    reuse = trace_stats(trace)["prefix_reuse"]
    assert reuse == naive_prefix_reuse(raw, 4) == 8 / 49   # conv-g2 hits [5, 6]
    same = {tuple(r.hash_ids[:2]) for r in trace.requests if r.request_id.startswith(
        ("conv-b.m000", "conv-g1"))}
    assert len(same) == 2


def test_a_json_list_of_objects(tmp_path):
    objects = [json.loads(line) for line in
               (FIXTURES / "agentx_many.jsonl").read_text().splitlines()]
    path = tmp_path / "list.json"
    path.write_text(json.dumps(objects, indent=2))
    listed, lines = load_trace(path), load_trace(FIXTURES / "agentx_many.jsonl")
    assert listed.requests == lines.requests


def _one(requests, **top) -> str:
    return json.dumps({"id": "t", "block_size": 4, "requests": requests, **top})


@pytest.mark.parametrize(("text", "line", "pattern"), [
    (_one([{"t": 0, "type": "n", "in": 8, "out": 1, "hash_ids": [1]}]), 1,
     r"trace 't' requests\[0\]: hash_ids has 1 ids but input_length 8 needs"),
    (_one([{"t": 0, "type": "n", "in": "8", "out": 1}]), 1,
     r"trace 't' requests\[0\]: field 'in' must be an integer, got string"),
    (_one([{"t": 0, "type": "x", "in": 8, "out": 1}]), 1,
     r"requests\[0\]: expected an object with 'type' one of 's', 'n', 'subagent'"),
    (_one([{"t": 0, "type": "n", "in": 4, "out": 1},
           {"t": 1, "type": "subagent", "requests": [{"t": 1, "type": "subagent"}]}]), 1,
     r"requests\[1\].requests\[0\]: .*nested subagents are not supported"),
    (_one([], hash_id_scope="world"), 1, r"hash_id_scope must be one of local, global"),
    (_one([{"t": 0, "type": "n", "in": 4, "out": 1}]) + "\n"
     + _one([{"t": 0, "type": "n", "in": 4, "out": 1}]), 2, r"duplicate trace id 't'"),
    ('{"id": "t", "block_size": 4,\n "requests": [,]}', 2, r"invalid JSON"),
    # a damaged count with no hash_ids: refused in order, no 2**31 ids minted for it
    (_one([{"t": 0, "type": "n", "in": 4, "out": 1},
           {"t": 1, "type": "n", "in": 2**33, "out": 1}]), 1,
     r"requests\[1\]: input_length must be > 0 and <= 2\*\*27, got 8589934592"),
])
def test_errors_name_the_object_and_entry(tmp_path, text, line, pattern):
    path = tmp_path / "t.json"
    path.write_text(text)
    with pytest.raises(TraceError, match=rf"^{path}:{line}: .*{pattern}"):
        load_trace(path, format="agentx")


def test_an_object_over_several_lines_is_detected_without_reading_it(monkeypatch, tmp_path):
    """`--format auto` on an indented AgentX document: its loader reads it, once."""
    from labkit.traces.formats import detect

    def refuse(text):
        raise AssertionError("detection parsed the whole document")

    monkeypatch.setattr(detect, "loads", refuse)
    path = tmp_path / "one.json"
    path.write_text(json.dumps(json.loads((FIXTURES / "agentx.json").read_text()), indent=2))
    assert load_trace(path).requests == load_trace(FIXTURES / "agentx.json",
                                                   format="agentx").requests
