"""Damaged or mis-encoded trace files are refused with a TraceError naming the file.

Issue 12, item 9: binary bytes, UTF-16, Latin-1, truncated or corrupt gzip, deeply
nested JSON each raised a different traceback (UnicodeDecodeError, EOFError,
zlib.error, RecursionError). Each must be a `TraceError` naming the file — and the
line, where the damage sits on one — from `load_trace` and from `labkit trace stats`
(exit 2, one line on stderr). Also: epoch-nanosecond Mooncake timestamps (their unit
detected, item 12) and a huge `output_length` in `trace stats` (bounded memory,
item 10).
"""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from labkit.cli import main
from labkit.traces import TraceError, generate_agentx_trace, load_trace, trace_stats, write_trace

GOOD = {"block_size": 16, "session_id": "s", "request_id": "r1", "parent_id": None,
        "kind": "main", "delay_s": 0.0, "input_length": 20, "output_length": 3,
        "hash_ids": [1, 2], "timestamp": None, "priority": 0}


def good_lines(n: int = 3) -> list[str]:
    return [json.dumps({**GOOD, "session_id": f"s{i}", "request_id": f"r{i}"})
            for i in range(n)]


def latin1(path):
    lines = good_lines()
    lines[1] = lines[1].replace('"s1"', '"s\u00e91"')  # é, as one Latin-1 byte
    path.write_bytes("\n".join(lines).encode("latin-1") + b"\n")
    return 2


def utf16(path):
    path.write_bytes("\n".join(good_lines()).encode("utf-16"))
    return None


def binary(path):
    path.write_bytes(bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)))
    return None


def truncated_gzip(path):
    data = gzip.compress("\n".join(good_lines(200)).encode() + b"\n")
    path.write_bytes(data[: len(data) // 2])
    return None


def corrupt_gzip(path):
    data = bytearray(gzip.compress("\n".join(good_lines(200)).encode() + b"\n"))
    for i in range(40, 80):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    return None


def not_gzip(path):
    path.write_bytes(("\n".join(good_lines()) + "\n").encode())
    return None


def nested(path):
    lines = good_lines()
    lines[2] = "[" * 200_000 + "]" * 200_000
    path.write_text("\n".join(lines) + "\n")
    return 3


def nested_in_a_field(path):
    lines = good_lines()
    lines[1] = lines[1].replace('"priority": 0', '"priority": ' + "[" * 100_000 + "]" * 100_000)
    path.write_text("\n".join(lines) + "\n")
    return 2


CASES = {  # name: (file name, writer -> the line to name or None)
    "latin-1": ("t.jsonl", latin1),
    "utf-16": ("t.jsonl", utf16),
    "binary": ("t.jsonl", binary),
    "truncated gzip": ("t.jsonl.gz", truncated_gzip),
    "corrupt gzip": ("t.jsonl.gz", corrupt_gzip),
    "not gzip": ("t.jsonl.gz", not_gzip),
    "deeply nested": ("t.jsonl", nested),
    "deeply nested field": ("t.jsonl", nested_in_a_field),
}


CSV_HEADER = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
CSV_ROWS = "".join(f"{t},ChatGPT,{100 + t},5,{105 + t},Conversation log\n" for t in range(300))


def csv_latin1(path):
    rows = CSV_ROWS.splitlines(keepends=True)
    rows[1] = rows[1].replace("ChatGPT", "Chat\u00e9GPT")
    path.write_bytes((CSV_HEADER + "".join(rows)).encode("latin-1"))
    return 3


def csv_truncated_gzip(path):
    data = gzip.compress((CSV_HEADER + CSV_ROWS).encode())
    path.write_bytes(data[: len(data) // 2])
    return None


def csv_corrupt_gzip(path):
    data = bytearray(gzip.compress((CSV_HEADER + CSV_ROWS).encode()))
    for i in range(40, 80):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    return None


def csv_huge_cell(path):
    path.write_text(CSV_HEADER + '1,"' + "x" * 200_000 + '",5,5,10,Conversation log\n')
    return 2


CSV_CASES = {"latin-1": ("t.csv", csv_latin1), "truncated gzip": ("t.csv.gz", csv_truncated_gzip),
             "corrupt gzip": ("t.csv.gz", csv_corrupt_gzip),
             "a cell past the csv limit": ("t.csv", csv_huge_cell)}


# (case table, case, format, is the line named exactly?): mooncake stops at line 1's
# fields; auto on a CSV reads line 1 before the loader. The CSV cases were raw
# zlib.error, EOFError, UnicodeDecodeError and csv.Error.
DAMAGED = [(CASES, case, fmt, fmt != "mooncake") for case in CASES
           for fmt in ("auto", "labkit", "mooncake")] + \
          [(CSV_CASES, case, fmt, fmt == "burstgpt") for case in CSV_CASES
           for fmt in ("auto", "burstgpt")]


@pytest.mark.parametrize(("cases", "case", "fmt", "exact"), DAMAGED)
def test_a_damaged_trace_is_a_trace_error_naming_the_file(tmp_path, cases, case, fmt, exact):
    name, write = cases[case]
    path = tmp_path / name
    line = write(path)
    with pytest.raises(TraceError) as err:
        load_trace(path, format=fmt)
    assert err.value.path == str(path)
    assert str(path) in str(err.value)
    if line is not None and exact:
        assert err.value.line == line


@pytest.mark.parametrize("case", list(CASES))
def test_trace_stats_on_a_damaged_trace_exits_2_with_one_line(tmp_path, capsys, case):
    name, write = CASES[case]
    path = tmp_path / name
    write(path)
    code = main(["trace", "stats", str(path)])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and "Traceback" not in captured.err


def test_a_utf8_byte_order_mark_is_accepted(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + ("\n".join(good_lines()) + "\n").encode())
    assert len(load_trace(path).requests) == 3


MOONCAKE = [  # relative milliseconds, as Mooncake publishes them
    {"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]},
    {"timestamp": 1500, "input_length": 600, "output_length": 10, "hash_ids": [1, 3]},
    {"timestamp": 4250, "input_length": 1100, "output_length": 10, "hash_ids": [1, 3, 4]},
]


@pytest.mark.parametrize("unit, scale", [("ms", 10**6), ("us", 10**3), ("ns", 1),
                                         ("s", 10**9)])
def test_mooncake_epoch_timestamps_are_read_in_their_unit(tmp_path, unit, scale):
    """The same arrivals written as epoch stamps in ns, us, ms or s load as seconds
    from the first arrival (1.5 s and 4.25 s apart), not as 1e15-second offsets
    whose float spacing rounds every latency to 0."""
    epoch_ns = 1_700_000_000_123_000_000
    path = tmp_path / "mc.jsonl"
    rows = []
    for r in MOONCAKE:
        ns = epoch_ns + r["timestamp"] * 10**6
        rows.append(json.dumps({**r, "timestamp": ns // scale if unit != "s" else ns / scale}))
    path.write_text("\n".join(rows) + "\n")
    stamps = [r.timestamp for r in load_trace(path).requests]
    assert stamps == pytest.approx([0.0, 1.5, 4.25], abs=1e-6)


def test_mooncake_relative_milliseconds_are_unchanged(tmp_path):
    path = tmp_path / "mc.jsonl"
    path.write_text("\n".join(json.dumps({**r, "timestamp": r["timestamp"] + 277})
                              for r in MOONCAKE) + "\n")
    assert [r.timestamp for r in load_trace(path).requests] == [0.277, 1.777, 4.527]


def test_an_epoch_nanosecond_mooncake_replay_has_real_latencies(tmp_path, capsys):
    path = tmp_path / "mc.jsonl"
    path.write_text("\n".join(json.dumps({**r, "timestamp": 1_700_000_000 * 10**9
                                          + r["timestamp"] * 10**6}) for r in MOONCAKE) + "\n")
    code = main(["replay", "--trace", str(path), "--model", "llama-3.1-8b", "--open-loop",
                 "--json", "--no-progress"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["requests_completed"] == 3
    assert summary["ttft_p50_s"] > 0 and summary["sim_duration_s"] < 60


def test_trace_stats_of_a_huge_output_length_stays_small(tmp_path, capsys):
    """A 1e12-token output must not be materialised as 1.5e10 block ids (116 GiB)."""
    import resource

    trace = generate_agentx_trace(2, seed=1, block_size=64)
    big = trace.requests[-1]
    big.output_length = 10**12
    path = tmp_path / "big.jsonl"
    write_trace(trace, path)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    stats = trace_stats(load_trace(path))
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert stats["total_output_tokens"] >= 10**12
    assert grown_kib < 512 * 1024  # well under half a GiB
    # the reuse figure is that of the same trace with an ordinary last output
    big.output_length = 1
    assert stats["prefix_reuse"] == trace_stats(trace)["prefix_reuse"]
