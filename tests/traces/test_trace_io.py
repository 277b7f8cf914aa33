"""Writing and reading labkit JSONL: round trips and atomic writes."""
from __future__ import annotations

import json

import numpy as np
import pytest
from trace_helpers import req

import labkit.traces.io as trace_io
from labkit.traces import Trace, generate_agentx_trace, load_trace, write_trace


def _hand_made() -> Trace:
    return Trace(4, [
        req("a", 9, [0, 1, 2], output_length=3, timestamp=1.25, priority=2),
        req("b", 13, [0, 1, 3, 4], parent="a", delay_s=0.1 + 0.2, output_length=2),
        req("c", 15, [0, 1, 3, 5], parent="a", kind="subagent", delay_s=1e-9),
        req("z", 4, [7], session="t", output_length=5),
    ])


@pytest.mark.parametrize("make", [_hand_made, lambda: generate_agentx_trace(2, seed=3)])
def test_round_trip_gives_identical_requests(tmp_path, make):
    trace = make()
    path = tmp_path / "t.jsonl"
    write_trace(trace, path)
    loaded = load_trace(path)
    assert loaded.block_size == trace.block_size
    assert loaded.format == "labkit" and loaded.source == str(path)
    assert len(loaded.requests) == len(trace.requests)
    for a, b in zip(loaded.requests, trace.requests, strict=True):
        assert a == b
        assert type(a.delay_s) is float and a.hash_ids.dtype == np.int64
    # A second round trip is byte-identical: nothing drifts (floats, key order).
    write_trace(loaded, tmp_path / "u.jsonl")
    assert (tmp_path / "u.jsonl").read_bytes() == path.read_bytes()


def test_file_has_one_object_per_line_with_schema_keys(tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(_hand_made(), path)
    lines = path.read_text().splitlines()
    assert len(lines) == 4
    first = json.loads(lines[0])
    assert set(first) == {"block_size", "session_id", "request_id", "parent_id", "kind",
                          "delay_s", "input_length", "output_length", "hash_ids",
                          "timestamp", "priority"}
    assert first["block_size"] == 4 and first["hash_ids"] == [0, 1, 2]
    assert first["timestamp"] == 1.25 and json.loads(lines[1])["timestamp"] is None


def test_optional_fields_default(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"block_size": 2, "session_id": "s", "request_id": "r",
                                "parent_id": None, "kind": "main", "delay_s": 0,
                                "input_length": 3, "output_length": 1,
                                "hash_ids": [5, 6]}) + "\n\n")  # blank lines are skipped
    (r,) = load_trace(path, format="labkit").requests
    assert r.timestamp is None and r.priority == 0 and r.delay_s == 0.0


def test_failed_write_leaves_no_partial_file(tmp_path, monkeypatch):
    path = tmp_path / "t.jsonl"
    write_trace(_hand_made(), path)
    before = path.read_bytes()
    calls = {"n": 0}
    real_line = trace_io._line

    def failing_line(r, bs):  # fail after some lines were already written
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("disk full")
        return real_line(r, bs)

    monkeypatch.setattr(trace_io, "_line", failing_line)
    with pytest.raises(RuntimeError, match="disk full"):
        write_trace(generate_agentx_trace(1, seed=0), path)
    assert path.read_bytes() == before                # old file untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]  # no temp left
    calls["n"] = 0
    with pytest.raises(RuntimeError):
        write_trace(_hand_made(), tmp_path / "new.jsonl")
    assert not (tmp_path / "new.jsonl").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]


def test_unknown_format_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="format"):
        load_trace(tmp_path / "x.jsonl", format="csv")


def test_missing_folders_are_created_and_errors_name_the_target(tmp_path):
    path = tmp_path / "runs" / "deeper" / "t.jsonl"
    write_trace(_hand_made(), path)
    assert load_trace(path).requests == _hand_made().requests
    (tmp_path / "afile").write_text("")
    with pytest.raises(OSError) as err:
        write_trace(_hand_made(), tmp_path / "afile" / "t.jsonl")
    message = str(err.value)
    assert "afile/t.jsonl" in message and "is a file, not a folder" in message
    assert ".tmp" not in message


def test_cli_trace_gen_creates_its_folder(tmp_path, monkeypatch, capsys):
    from labkit.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["trace", "gen", "--sessions", "1", "--out", "runs/one.jsonl"]) == 0
    assert len(load_trace(tmp_path / "runs" / "one.jsonl").requests) > 1
    assert main(["trace", "gen", "--sessions", "1", "--out", "runs/one.jsonl/x.jsonl"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("labkit: error: cannot write runs/one.jsonl/x.jsonl")
    assert ".tmp" not in err
