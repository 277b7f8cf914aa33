"""A malformed trace is rejected before use, with "<path>:<line>: <reason>"."""
from __future__ import annotations

import json
import re

import pytest
from trace_helpers import req

from labkit.traces import Trace, TraceError, load_trace


def good(rid: str, parent: str | None = None, **over) -> dict:
    """A valid labkit line (block size 4, 6 tokens -> 2 ids)."""
    line = {"block_size": 4, "session_id": "s", "request_id": rid, "parent_id": parent,
            "kind": "main", "delay_s": 0.5, "input_length": 6, "output_length": 2,
            "hash_ids": [1, 2]}
    line.update(over)
    return line


def write(tmp_path, *lines) -> str:
    path = tmp_path / "bad.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n"
                            for x in lines))
    return str(path)


def expect_error(path: str, line: int, reason_pattern: str, format: str = "auto"):
    with pytest.raises(TraceError) as info:
        load_trace(path, format=format)
    err = info.value
    assert isinstance(err, ValueError)
    assert (err.path, err.line) == (path, line)
    assert str(err) == f"{path}:{line}: {err.reason}"
    assert re.search(reason_pattern, err.reason), err.reason


def without(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


def test_bad_json(tmp_path):
    expect_error(write(tmp_path, good("a"), '{"block_size": 4,'), 2, r"invalid JSON")


def test_not_an_object(tmp_path):
    expect_error(write(tmp_path, good("a"), "[1, 2]"), 2, r"expected a JSON object")


@pytest.mark.parametrize("field", ["block_size", "session_id", "request_id", "parent_id",
                                   "kind", "delay_s", "input_length", "output_length",
                                   "hash_ids"])
def test_missing_field(tmp_path, field):
    path = write(tmp_path, good("a"), good("b", "a"), without(good("c", "b"), field))
    expect_error(path, 3, rf"missing field '{field}'", format="labkit")


def test_unknown_field(tmp_path):
    expect_error(write(tmp_path, good("a"), good("b", "a", colour="red")), 2,
                 r"unknown field 'colour'")


@pytest.mark.parametrize("field,value,expected", [
    ("input_length", "6", "an integer"), ("input_length", 6.0, "an integer"),
    ("output_length", True, "an integer"), ("delay_s", "1s", "a number"),
    ("session_id", 3, "a string"), ("parent_id", 7, "a string or null"),
    ("hash_ids", "1,2", "a list of integers"), ("hash_ids", [1, 2.5], "a list of integers"),
    ("hash_ids", [1, None], "a list of integers"), ("hash_ids", [[1], [2]], "a list of integers"),
    ("timestamp", "now", "a number or null"),
    ("priority", 0.5, "an integer"), ("block_size", "4", "an integer"),
])
def test_wrong_type(tmp_path, field, value, expected):
    expect_error(write(tmp_path, good("a"), good("b", "a", **{field: value})), 2,
                 rf"field '{field}' must be {re.escape(expected)}")


@pytest.mark.parametrize("field,value,pattern", [
    ("input_length", 0, r"input_length must be > 0"),
    ("input_length", -4, r"input_length must be > 0"),
    ("output_length", 0, r"output_length must be >= 1"),
    ("delay_s", -1.0, r"delay_s must be .*>= 0"),
    ("timestamp", -2.0, r"timestamp must be .*>= 0"),
    ("block_size", 0, r"block_size must be > 0"),
])
def test_non_positive_values(tmp_path, field, value, pattern):
    expect_error(write(tmp_path, good("a"), good("b", "a", **{field: value})), 2, pattern)


@pytest.mark.parametrize("ids", [[1], [1, 2, 3]])
def test_hash_ids_length_must_match_blocks(tmp_path, ids):
    expect_error(write(tmp_path, good("a"), good("b", "a", hash_ids=ids)), 2,
                 rf"hash_ids has {len(ids)} ids but input_length 6 needs ceil\(6/4\) = 2")


@pytest.mark.parametrize("ids", [[1, -1], [1, 2**40]])
def test_hash_ids_out_of_range(tmp_path, ids):
    expect_error(write(tmp_path, good("a"), good("b", "a", hash_ids=ids)), 2,
                 r"\[0, 2\*\*40\)")


def test_inconsistent_block_size(tmp_path):
    path = write(tmp_path, good("a"), good("b", "a"),
                 good("c", "b", block_size=8, hash_ids=[1]))
    expect_error(path, 3, r"block_size 8 differs from 4 \(line 1\)")


def test_duplicate_request_id(tmp_path):
    path = write(tmp_path, good("a"), good("b", "a"), good("a", session_id="t"))
    expect_error(path, 3, r"duplicate request_id 'a' \(first at line 1\)")


def test_unknown_parent(tmp_path):
    expect_error(write(tmp_path, good("a"), good("b", "nope")), 2,
                 r"unknown parent_id 'nope'")


def test_later_parent(tmp_path):
    path = write(tmp_path, good("a"), good("b", "c"), "", good("c", "a"))
    expect_error(path, 2, r"parent_id 'c' refers to a later request \(line 4\)")


def test_cross_session_parent(tmp_path):
    path = write(tmp_path, good("a"), good("x", session_id="t"), good("b", "x"))
    expect_error(path, 3, r"parent_id 'x' belongs to session 't', not 's'")


def test_main_call_with_subagent_parent(tmp_path):
    path = write(tmp_path, good("a"), good("sub", "a", kind="subagent"), good("b", "sub"))
    expect_error(path, 3, r"main call's parent 'sub' is a subagent call")


def test_bad_kind(tmp_path):
    expect_error(write(tmp_path, good("a"), good("b", "a", kind="tool")), 2,
                 r"kind must be 'main' or 'subagent', got 'tool'")


def test_subagent_without_parent(tmp_path):
    expect_error(write(tmp_path, good("a"), good("b", kind="subagent")), 2,
                 r"subagent call needs a parent_id")


def test_second_main_child(tmp_path):
    path = write(tmp_path, good("a"), good("b", "a"), good("c", "a"))
    expect_error(path, 3, r"'a' already has a main child")


def test_second_subagent_child(tmp_path):
    path = write(tmp_path, good("a"), good("x", "a", kind="subagent"),
                 good("y", "a", kind="subagent"),             # parallel forks are fine
                 good("x2", "x", kind="subagent"), good("x3", "x", kind="subagent"))
    expect_error(path, 5, r"'x' already has a subagent child")


def test_empty_file(tmp_path):
    expect_error(write(tmp_path, ""), 1, r"empty trace")


def test_first_error_wins_across_kinds(tmp_path):
    # Line 2's forward parent is found only by the link pass, line 3 is bad JSON:
    # the error reported is still the earliest one.
    path = write(tmp_path, good("a"), good("b", "c"), "{oops", good("c", "a"))
    expect_error(path, 2, r"parent_id 'c'")
    path = write(tmp_path, good("a"), "{oops", good("b", "zzz"))
    expect_error(path, 2, r"invalid JSON")


def test_mooncake_lines_are_validated(tmp_path):
    line = {"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}
    path = write(tmp_path, line, dict(line, hash_ids=[1]))
    expect_error(path, 2, r"hash_ids has 1 ids but input_length 600 needs ceil\(600/512\)")
    expect_error(write(tmp_path, line, dict(line, extra=1)), 2, r"unknown field 'extra'",
                 format="mooncake")
    expect_error(write(tmp_path, line, without(line, "timestamp")), 2,
                 r"missing field 'timestamp'", format="mooncake")


def test_programmatic_trace_is_validated_too():
    with pytest.raises(TraceError, match=r"^<trace>:2: unknown parent_id 'q'$"):
        Trace(4, [req("a", 4, [1]), req("b", 4, [1], parent="q")])
    with pytest.raises(TraceError, match=r"^<trace>:1: hash_ids has 2 ids"):
        Trace(4, [req("a", 4, [1, 2])])
