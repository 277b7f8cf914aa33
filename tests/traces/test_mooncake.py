"""The Mooncake loader: open-loop requests, timestamps in seconds, 512-token blocks."""
from __future__ import annotations

import json

import numpy as np
from trace_helpers import naive_prefix_reuse

from labkit.traces import load_trace, trace_stats


def test_reference_file(mooncake_path):
    lines = [json.loads(x) for x in mooncake_path.read_text().splitlines()]
    trace = load_trace(mooncake_path)                 # auto-detected
    assert trace.format == "mooncake" and trace.block_size == 512
    assert len(trace) == len(lines) == 3993
    assert len(trace.sessions()) == 3993
    for n, (line, r) in enumerate(zip(lines, trace.requests, strict=True), start=1):
        assert r.request_id == r.session_id == f"mc-{n}"
        assert r.parent_id is None and r.kind == "main" and r.delay_s == 0.0
        assert r.timestamp == line["timestamp"] / 1000
        assert (r.input_length, r.output_length) == (line["input_length"],
                                                     line["output_length"])
        assert r.hash_ids.tolist() == line["hash_ids"]  # already chain-unique: unchanged
    assert trace.requests[-1].timestamp == 1022.025      # ms -> s
    stats = trace_stats(trace)
    assert stats["duration_s"] == max(x["timestamp"] for x in lines) / 1000
    assert stats["prefix_reuse"] == naive_prefix_reuse(trace.requests, 512)


def test_small_file(tmp_path):
    path = tmp_path / "mc.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in [
        {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 1500, "input_length": 1100, "output_length": 7, "hash_ids": [0, 1, 2]},
    ]))
    trace = load_trace(path, format="mooncake")
    a, b = trace.requests
    assert [a.timestamp, b.timestamp] == [0.0, 1.5]
    assert b.request_id == "mc-2" and b.hash_ids.dtype == np.int64
    # b re-uses a's first full block only (1000 tokens = 1 full block + 488).
    assert trace_stats(trace)["prefix_reuse"] == 512 / 2100
