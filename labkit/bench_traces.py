"""`labkit bench traces`: how fast a large trace is written, read and described.

The trace is `labkit bench sim`'s fast workload's — 400 AgentX-like sessions with
contexts up to 200K tokens (`bench_sim.FAST_TRACE_*`; 20 sessions with `--quick`):
some 300 MB of JSON, nearly all of it block ids. It is generated (twice, the least CPU
time kept), then written as labkit JSONL and as AgentX / Weka trace objects (one per
line, a session's calls listed as main calls), and each file is loaded; writing and
loading are timed twice each way, alternating: with the block-id lists read and spelt
by compiled loops (`traces/id_lists.py`) and by `json` alone (`id_lists.json_only`,
the code path before them). The two ways must give the same bytes and the same
requests (checked and printed). Then `trace_stats` (prefix reuse in one compiled
pass). Then the token-count CSV formats at a published trace's scale: 200,000 rows
(20,000 with `--quick`) of BurstGPT and of Azure 2024, loaded a column at a time
(`formats/csv_columns.py`) and row by row (`csv_columns.rows_only`). Printed: the
file's MB, CPU seconds (least of the tries), MB per CPU second, and the speed-up.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time

import numpy as np
import pandas as pd

TRIES = 2  # timings per way; the least CPU time is kept


def bench_traces(quick: bool = False) -> pd.DataFrame:
    from labkit.bench_sim import FAST_TRACE_KNOBS, FAST_TRACE_SESSIONS
    from labkit.traces import generate_agentx_trace, load_trace, trace_stats, write_trace
    from labkit.traces.id_lists import json_only

    sessions = 20 if quick else FAST_TRACE_SESSIONS
    generated = {}
    for _ in range(TRIES):
        _time(generated, "generate", lambda: generate_agentx_trace(sessions,
                                                                     **FAST_TRACE_KNOBS))
    made_in, trace = generated["generate"]
    print(f"labkit bench traces — {sessions} AgentX-like sessions, {len(trace)} calls, "
          f"{sum(len(r.hash_ids) for r in trace.requests) / 1e6:.1f}M block ids\n")
    rows = [_single("generate AgentX", made_in)]
    with tempfile.TemporaryDirectory(prefix="labkit-bench-traces-") as tmp:
        files = {"labkit JSONL": os.path.join(tmp, "t.jsonl"),
                 "AgentX objects": os.path.join(tmp, "t.agentx.jsonl")}
        write_trace(trace, files["labkit JSONL"])
        write_agentx_lines(trace, files["AgentX objects"])
        timed = {}
        for _ in range(TRIES):
            for way in ("compiled", "json"):
                with json_only() if way == "json" else contextlib.nullcontext():
                    _time(timed, ("write", "labkit JSONL", way), write_trace, trace,
                          os.path.join(tmp, f"{way}.jsonl"))
                    for name, path in files.items():
                        _time(timed, ("load", name, way), load_trace, path)
        for (verb, name, way), (fast, result) in timed.items():
            if way != "compiled":
                continue
            slow, reference = timed[(verb, name, "json")]
            same = (_same_file(files[name], os.path.join(tmp, "compiled.jsonl"))
                    and _same_file(files[name], os.path.join(tmp, "json.jsonl"))
                    if verb == "write" else _same_requests(result, reference))
            size = os.path.getsize(files[name]) / 1e6
            rows.append({"step": f"{verb} {name}", "MB": size, "cpu_s": fast,
                         "MB_per_s": size / fast, "before_cpu_s": slow, "speedup": slow / fast,
                         "identical": same})
        loaded = timed[("load", "labkit JSONL", "compiled")][1]
        rows += _csv_rows(tmp, 20_000 if quick else 200_000)
    cpu = time.process_time()
    stats = trace_stats(loaded)
    rows.append(_single("trace stats", time.process_time() - cpu))
    table = pd.DataFrame(rows)
    print(table.round(3).to_string(index=False))
    print(f"\nprefix reuse {stats['prefix_reuse']:.4f}")
    return table


def _single(step: str, cpu_s: float) -> dict:
    """A row for a step timed one way only (no code path before it to compare)."""
    return {"step": step, "MB": np.nan, "cpu_s": cpu_s, "MB_per_s": np.nan,
            "before_cpu_s": np.nan, "speedup": np.nan, "identical": None}


def _csv_rows(tmp: str, n: int) -> list[dict]:
    """Load a BurstGPT and an Azure 2024 CSV of `n` rows both ways (see the module
    docstring)."""
    from labkit.traces import load_trace
    from labkit.traces.formats.csv_columns import rows_only

    rng = np.random.default_rng(0)
    seconds = np.cumsum(rng.exponential(0.2, n))
    inputs, outputs = rng.integers(1, 8000, n), rng.integers(0, 1000, n)
    files = {"BurstGPT CSV": os.path.join(tmp, "burstgpt.csv"),
             "Azure 2024 CSV": os.path.join(tmp, "azure.csv")}
    with open(files["BurstGPT CSV"], "w", encoding="utf-8") as f:
        f.write("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n")
        f.writelines(f"{t:.3f},ChatGPT,{i},{o},{i + o},Conversation log\n"
                     for t, i, o in zip(seconds, inputs, outputs))
    start = pd.Timestamp("2024-05-10", tz="UTC")
    stamps = (start + pd.to_timedelta(np.round(seconds * 1e6), unit="us")).strftime(
        "%Y-%m-%d %H:%M:%S.%f+00:00")
    with open(files["Azure 2024 CSV"], "w", encoding="utf-8") as f:
        f.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
        f.writelines(f"{t},{i},{o}\n" for t, i, o in zip(stamps, inputs, outputs))
    timed, rows = {}, []
    for _ in range(TRIES):
        for way in ("columns", "rows"):
            with rows_only() if way == "rows" else contextlib.nullcontext():
                for name, path in files.items():
                    _time(timed, (name, way), load_trace, path)
    for name, path in files.items():
        (fast, result), (slow, reference) = timed[(name, "columns")], timed[(name, "rows")]
        size = os.path.getsize(path) / 1e6
        rows.append({"step": f"load {name}", "MB": size, "cpu_s": fast,
                     "MB_per_s": size / fast, "before_cpu_s": slow, "speedup": slow / fast,
                     "identical": _same_requests(result, reference)})
    return rows


def write_agentx_lines(trace, path: str) -> None:
    """The trace as AgentX / Weka trace objects, one session per line, its calls in
    order as main calls (the shape the loader reads; a benchmark's input)."""
    from labkit.traces.id_lists import ids_json

    with open(path, "w", encoding="utf-8") as f:
        for session in trace.sessions():
            calls = ",".join(
                f'{{"t":0.0,"type":"s","in":{r.input_length},"out":{r.output_length},'
                f'"hash_ids":{ids_json(r.hash_ids)}}}' for r in session)
            f.write(f'{{"id":"{session[0].session_id}","block_size":{trace.block_size},'
                    f'"requests":[{calls}]}}\n')


def _time(timed: dict, key, fn, *args) -> None:
    cpu = time.process_time()
    result = fn(*args)
    took = time.process_time() - cpu
    if key not in timed or took < timed[key][0]:
        timed[key] = (took, result)


def _same_file(a: str, b: str) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        return fa.read() == fb.read()


def _same_requests(a, b) -> bool:
    return len(a.requests) == len(b.requests) and all(
        (x.session_id, x.request_id, x.parent_id, x.kind, x.delay_s, x.input_length,
         x.output_length, x.timestamp) == (y.session_id, y.request_id, y.parent_id, y.kind,
                                           y.delay_s, y.input_length, y.output_length,
                                           y.timestamp)
        and x.hash_ids.dtype == y.hash_ids.dtype and np.array_equal(x.hash_ids, y.hash_ids)
        for x, y in zip(a.requests, b.requests))
