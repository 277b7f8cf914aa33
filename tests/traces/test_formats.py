"""The published trace formats: fixture files written from each format's published
schema, loaded into sessions / parents / delays checked by hand, prefix reuse checked
against the chain-keyed reference on the raw ids."""
from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from trace_helpers import naive_prefix_reuse, req

from labkit.cli import main
from labkit.traces import FORMATS, TraceError, load_trace, trace_stats
from labkit.traces.canonical import is_chain_unique
from labkit.traces.validate import MAX_HASH_ID

FIXTURES = Path(__file__).parent / "fixtures"
FIXTURE_FORMATS = {"bailian.jsonl": "bailian", "azure_2023.csv": "azure",
                   "azure_2024.csv": "azure", "burstgpt.csv": "burstgpt",
                   "burstgpt_sessions.csv": "burstgpt", "splitwise.csv": "splitwise",
                   "agentx.json": "agentx", "agentx_many.jsonl": "agentx"}


def shape(trace) -> list[tuple]:
    return [(r.request_id, r.session_id, r.parent_id, r.kind, r.input_length,
             r.output_length) for r in trace.requests]


def test_bailian_sessions_parents_and_reuse():
    trace = load_trace(FIXTURES / "bailian.jsonl")
    assert (trace.format, trace.block_size) == ("bailian", 16)
    # By arrival (chat 15, t=2.0, is written after chat 12, t=3.0); the blank line counts.
    assert shape(trace) == [
        ("bl-10", "bl-10", None, "main", 40, 20),
        ("bl-11", "bl-11", None, "main", 20, 5),
        ("bl-15", "bl-15", None, "main", 16, 1),       # parent 99 is outside: own session;
        ("bl-12", "bl-10", "bl-10", "main", 90, 10),   # output 0 is replayed as 1 token
        ("bl-14", "bl-14", None, "main", 70, 8),       # a second answer to chat 10: a branch
        ("bl-13", "bl-10", "bl-12", "main", 120, 6),
    ]
    assert [r.timestamp for r in trace.requests] == [0.5, 1.0, 2.0, 3.0, 4.0, 9.0]
    assert [r.delay_s for r in trace.requests] == [0.0, 0.0, 0.0, 2.5, 0.0, 6.0]
    # The 2**45 hash is renumbered below 2**40; ids are chain-unique.
    assert all(r.hash_ids.max() < MAX_HASH_ID for r in trace.requests)
    assert is_chain_unique([r.hash_ids for r in trace.requests])
    raw = [req("bl-10", 40, [1, 2, 3], session="bl-10", output_length=20),
           req("bl-11", 20, [7, 2**45], session="bl-11", output_length=5),
           req("bl-15", 16, [30], session="bl-15"),
           req("bl-12", 90, [1, 2, 4, 5, 6, 9], session="bl-10", parent="bl-10",
               output_length=10),
           req("bl-14", 70, [1, 2, 4, 20, 21], session="bl-14", output_length=8),
           req("bl-13", 120, [1, 2, 4, 5, 6, 10, 11, 12], session="bl-10", parent="bl-12",
               output_length=6)]
    reuse = trace_stats(trace)["prefix_reuse"]
    assert reuse == naive_prefix_reuse(raw, 16)
    # By hand: bl-12 and bl-14 hit bl-10's context [1, 2, 4] (3 blocks, 48 tokens);
    # bl-13 hits bl-12's context [1, 2, 4, 5, 6, 10] (96 tokens).
    assert reuse == (48 + 48 + 96) / (40 + 20 + 16 + 90 + 70 + 120)


def test_bailian_ids_that_are_not_chain_unique_are_renumbered(tmp_path):
    path = tmp_path / "b.jsonl"
    rows = [{"chat_id": 1, "parent_chat_id": -1, "timestamp": 0, "input_length": 32,
             "output_length": 1, "hash_ids": [5, 6]},
            {"chat_id": 2, "parent_chat_id": -1, "timestamp": 1, "input_length": 48,
             "output_length": 1, "hash_ids": [6, 5, 7]},      # 5 after 6: other content
            {"chat_id": 3, "parent_chat_id": -1, "timestamp": 2, "input_length": 40,
             "output_length": 1, "hash_ids": [5, 6, 9]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trace = load_trace(path)
    assert is_chain_unique([r.hash_ids for r in trace.requests])
    raw = [req(f"bl-{r['chat_id']}", r["input_length"], r["hash_ids"], session=str(i))
           for i, r in enumerate(rows)]
    assert trace_stats(trace)["prefix_reuse"] == naive_prefix_reuse(raw, 16) == 32 / 120


def test_bailian_rows_without_hash_ids_get_fresh_ones(tmp_path):
    path = tmp_path / "b.jsonl"   # aiperf's documented example rows have no hash_ids
    path.write_text(json.dumps({"chat_id": 159, "parent_chat_id": -1, "timestamp": 61.114,
                                "input_length": 521, "output_length": 132, "type": "text",
                                "turn": 1}) + "\n" +
                    json.dumps({"chat_id": 160, "parent_chat_id": 159, "timestamp": 62.5,
                                "input_length": 40, "output_length": 8,
                                "hash_ids": [3, 2**45, 5]})
                    + "\n")
    first, second = load_trace(path).requests
    assert len(first.hash_ids) == 33 and second.parent_id == "bl-159"
    assert not set(first.hash_ids.tolist()) & set(second.hash_ids.tolist())


@pytest.mark.parametrize(("rows", "line", "pattern"), [
    ([{"chat_id": 1, "timestamp": 0, "input_length": 16, "output_length": 1,
       "hash_ids": [1]}, {"chat_id": 1, "timestamp": 1, "input_length": 16,
                          "output_length": 1, "hash_ids": [2]}], 2, r"duplicate chat_id 1"),
    ([{"chat_id": 1, "timestamp": 0, "input_length": 33, "output_length": 1,
       "hash_ids": [1, 2]}], 1, r"needs ceil\(33/16\) = 3"),
    ([{"chat_id": 1, "timestamp": 0, "input_length": 16, "output_length": 1,
       "hash_ids": [1], "user": "x"}], 1, r"unknown field 'user'"),
    ([{"chat_id": 1, "parent_chat_id": 2, "timestamp": 0, "input_length": 16,
       "output_length": 1, "hash_ids": [1]},
      {"chat_id": 2, "timestamp": 0, "input_length": 16, "output_length": 1,
       "hash_ids": [1]}], 1, r"parent_chat_id 2 arrives after this request \(line 2\)"),
    # a chat that is its own parent, and one whose id marks "no parent" (were KeyErrors)
    ([{"chat_id": 3, "parent_chat_id": 3, "timestamp": 0, "input_length": 16,
       "output_length": 1}], 1, r"chat_id 3 cannot be a chat's own parent"),
    ([{"chat_id": -1, "parent_chat_id": -1, "timestamp": 0, "input_length": 16,
       "output_length": 1}], 1, r"chat_id -1 cannot be a chat's own parent"),
    # a damaged count with no hash_ids: refused, not 2**60 fresh ids minted for it
    ([{"chat_id": 1, "timestamp": 0, "input_length": 16, "output_length": 1},
      {"chat_id": 2, "timestamp": 0, "input_length": 2**64, "output_length": 1}], 2,
     r"input_length must be > 0 and <= 2\*\*27"),
    ([{"chat_id": 1, "timestamp": 0, "input_length": 16, "output_length": 10**30}], 1,
     r"output_length must be >= 1 and <= 2\*\*40"),
])
def test_bailian_errors_name_the_line(tmp_path, rows, line, pattern):
    path = tmp_path / "b.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(TraceError, match=rf"^{path}:{line}: .*{pattern}"):
        load_trace(path, format="bailian")


@pytest.mark.parametrize(("name", "stamps", "lengths"), [
    ("azure_2023.csv", [0.0, 0.052, 1.12004], [(4000, 12), (130, 7), (65, 1)]),
    ("azure_2024.csv", [0.0, 1.5], [(1500, 40), (64, 3)]),   # +02:00 is two hours earlier
    ("splitwise.csv", [0.0127, 0.0305, 0.0305, 0.5],
     [(4000, 10), (300, 25), (300, 25), (70, 1)]),          # batch_size 2: two requests
    ("burstgpt.csv", [5.0, 5.0, 47.5], [(472, 18), (1200, 1), (30, 300)]),  # a failure
])
def test_token_count_formats(name, stamps, lengths):
    trace = load_trace(FIXTURES / name)
    assert trace.format == FIXTURE_FORMATS[name] and trace.block_size == 64
    assert [r.timestamp for r in trace.requests] == pytest.approx(stamps, abs=1e-9)
    assert [(r.input_length, r.output_length) for r in trace.requests] == lengths
    assert all(r.parent_id is None and r.session_id == r.request_id and r.delay_s == 0
               for r in trace.requests)
    # No content is published: every block gets its own id, nothing is reused.
    ids = np.concatenate([r.hash_ids for r in trace.requests])
    assert len(ids) == sum(-(-n // 64) for n, _ in lengths) == len(set(ids.tolist()))
    assert trace_stats(trace)["prefix_reuse"] == 0.0


def test_burstgpt_session_column_links_a_sessions_requests():
    trace = load_trace(FIXTURES / "burstgpt_sessions.csv")
    assert shape(trace) == [("bg-2", "bg-sa1", None, "main", 100, 10),
                            ("bg-3", "bg-3", None, "main", 50, 5),
                            ("bg-4", "bg-sa1", "bg-2", "main", 300, 20)]
    assert [r.delay_s for r in trace.requests] == [0.0, 0.0, 8.0]   # 9 s - 1 s


@pytest.mark.parametrize(("name", "text", "line", "pattern"), [
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,10,2\n"
              "yesterday,10,2\n", 3, r"column 'TIMESTAMP': 'yesterday' is not a date"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,1.5,2\n",
     2, r"column 'ContextTokens': '1.5' is not a whole number"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,0,2\n",
     2, r"input_length must be > 0"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,10,2\n"
              "2023-11-16 18:17:04,9999999999999,2\n", 3, r"input_length must be > 0 and <="),
    ("b.csv", "Timestamp,Model,Request tokens,Response tokens\n1,x,5,2000000000000\n", 2,
     r"output_length must be >= 1 and <= 2\*\*40"),
    ("b.csv", "Timestamp,Model,Request tokens,Response tokens\n1,x,5\n", 2,
     r"3 cells, but the header has 4 columns"),
    ("s.csv", "request_id,arrival_timestamp,prompt_size,token_size\n1,0,5,5\n1,1,5,5\n", 3,
     r"duplicate request_id '1' \(first at line 2\)"),
    ("x.csv", "time,prompt,output\n1,2,3\n", 1,
     r"cannot tell the trace format.*one of labkit, mooncake, bailian, azure, agentx, "
     r"burstgpt, splitwise"),
])
def test_csv_errors_name_the_line(tmp_path, name, text, line, pattern):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(TraceError, match=rf"^{path}:{line}: .*{pattern}"):
        load_trace(path)


def test_missing_column_lists_the_header(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:17:03.97,10\n")
    with pytest.raises(TraceError, match=r":1: Azure CSV needs column\(s\) 'GeneratedTokens'; "
                                         r"the header has 'TIMESTAMP', 'ContextTokens'"):
        load_trace(path, format="azure")


@pytest.mark.parametrize("name", sorted(FIXTURE_FORMATS))
def test_auto_detection_also_through_gzip(tmp_path, name):
    expected = load_trace(FIXTURES / name, format=FIXTURE_FORMATS[name])
    assert load_trace(FIXTURES / name).format == FIXTURE_FORMATS[name]
    packed = tmp_path / (name + ".gz")
    with open(FIXTURES / name, "rb") as src, gzip.open(packed, "wb") as dst:
        shutil.copyfileobj(src, dst)
    assert shape(load_trace(packed)) == shape(expected)


def test_a_format_is_one_of_the_list():
    assert FORMATS == ("labkit", "mooncake", "bailian", "azure", "agentx", "burstgpt",
                       "splitwise")
    with pytest.raises(ValueError, match=r"format must be one of auto, labkit, mooncake, "
                                         r"bailian, azure, agentx, burstgpt, splitwise"):
        load_trace(FIXTURES / "bailian.jsonl", format="sharegpt")
    with pytest.raises(TraceError, match=r":1: unknown field 'chat_id'"):
        load_trace(FIXTURES / "bailian.jsonl", format="mooncake")


@pytest.mark.parametrize("name", sorted(FIXTURE_FORMATS))
def test_convert_writes_the_same_trace_as_labkit_jsonl(tmp_path, name, capsys):
    out = tmp_path / "out.jsonl.gz"
    assert main(["trace", "convert", str(FIXTURES / name), str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    original, converted = load_trace(FIXTURES / name), load_trace(out)
    assert converted.format == "labkit" and converted.block_size == original.block_size
    assert converted.requests == original.requests
    assert trace_stats(converted)["prefix_reuse"] == trace_stats(original)["prefix_reuse"]


def test_compact_ids_renumber_as_ranks_among_the_distinct_ids():
    """Ids renumbered offset, offset + 1, ... by their rank among the distinct ids (a
    table where the ids are small, a sort where not): np.unique's inverse, checked."""
    from labkit.traces.formats.common import compact_ids

    rng = np.random.default_rng(7)
    for case in range(60):
        high = [50, 10_000, 2**45, 2**62][case % 4]
        low = -high if case % 5 == 0 else 0
        lists = [rng.integers(low, high, int(rng.integers(0, 30)), dtype=np.int64)
                 for _ in range(int(rng.integers(1, 6)))]
        offset = int(rng.integers(0, 1000))
        out, end = compact_ids(lists, offset)
        flat = np.concatenate(lists)
        if len(flat) == 0:
            assert end == offset
            continue
        distinct, inverse = np.unique(flat, return_inverse=True)
        assert end == offset + len(distinct)
        assert [o.dtype for o in out] == [np.int64] * len(lists)
        assert np.array_equal(np.concatenate(out), inverse + offset)
        assert [len(o) for o in out] == [len(x) for x in lists]
