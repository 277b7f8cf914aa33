"""The Perfetto timeline and the request Gantt view, against the run's own tables.

A DEP run (lockstep: stalls) with KV pressure (preemptions) and session moves (KV
fetches): the timeline's step slices must add up to each rank's busy time in
steps.parquet, every call must have a slice from its arrival to its finish in
requests.parquet, phases must meet the request timings, slices must nest on each
thread, and the file must be trace-event JSON. Fast-forward on or off gives the same
timeline.
"""

import gzip
import json
from collections import defaultdict

import numpy as np
import pandas as pd
import pytest

from labkit import Engine
from labkit.cli import main
from labkit.exporters import TimelineRecorder
from labkit.widgets import RequestGantt
from support import small_agentx

PHASES = {"queue", "prefill", "chunk", "decode", "kv_fetch", "kv_load"}


RUNS: dict = {}


def replay(fast_forward: bool):
    """Sessions without tool gaps on a pool barely larger than the longest call."""
    if fast_forward not in RUNS:
        engine = Engine("qwen3-30b-a3b", "dep2", "h200", max_model_len=60_000,
                        num_gpu_blocks_override=1351, sim_fast_forward=fast_forward)
        timeline = TimelineRecorder(engine)
        gantt = RequestGantt(engine, max_calls=10)
        result = engine.replay(small_agentx(8, seed=1), concurrency=8, duration_s=30,
                               max_idle_s=0)
        RUNS[fast_forward] = engine, timeline, gantt, result
    return RUNS[fast_forward]


@pytest.fixture(scope="module", params=[True, False], ids=["fast-forward", "step-by-step"])
def run(request, tmp_path_factory):
    engine, timeline, gantt, result = replay(request.param)
    path = tmp_path_factory.mktemp("timeline") / "run.json.gz"
    timeline.save(path)
    with gzip.open(path, "rt") as f:
        doc = json.load(f)
    return engine, timeline, gantt, result, doc


def test_the_run_exercises_what_the_timeline_draws(run):
    _, _, _, result, _ = run
    steps, requests = result.steps, result.requests
    assert steps["stall_s"].sum() > 0  # lockstep
    assert requests["preemptions"].sum() > 0
    assert requests["fetched_tokens"].sum() > 0
    assert requests["completed"].sum() > 100


def test_file_is_trace_event_json(run):
    *_, doc = run
    # displayTimeUnit "ms" would make Perfetto's importer read ts as milliseconds
    assert "traceEvents" in doc and "displayTimeUnit" not in doc
    kinds = defaultdict(int)
    for e in doc["traceEvents"]:
        assert {"ph", "name", "pid", "tid"} <= set(e)
        kinds[e["ph"]] += 1
        if e["ph"] == "X":
            assert isinstance(e["ts"], int) and isinstance(e["dur"], int) and e["dur"] >= 0
        elif e["ph"] == "C":
            assert isinstance(e["ts"], int) and e["args"]
            assert all(isinstance(v, (int, float)) for v in e["args"].values())
        else:
            assert e["ph"] == "M"
            assert e["name"] in {"process_name", "thread_name", "process_sort_index",
                                 "thread_sort_index"}
    assert kinds["X"] and kinds["C"] and kinds["M"]
    tids = defaultdict(set)  # a thread id belongs to one process
    for e in doc["traceEvents"]:
        tids[e["tid"]].add(e["pid"])
    assert all(len(p) == 1 for p in tids.values())


def test_slices_nest_on_every_thread(run):
    *_, doc = run
    by_thread = defaultdict(list)
    for e in doc["traceEvents"]:
        if e["ph"] == "X":
            by_thread[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for slices in by_thread.values():
        slices.sort(key=lambda s: (s[0], -s[1]))
        open_ends = []
        for start, end in slices:
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1], "a slice overlaps its parent's end"
            open_ends.append(end)


def test_step_slices_add_up_to_busy_time_per_rank(run):
    engine, _, _, result, doc = run
    steps = result.steps
    busy, stall, count = defaultdict(int), defaultdict(int), defaultdict(int)
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    for e in doc["traceEvents"]:
        if e["ph"] == "X" and e["cat"] == "step":
            rank = int(names[e["pid"]].removeprefix("DP rank "))
            busy[rank] += e["dur"]
            count[rank] += 1
        elif e["ph"] == "X" and e["cat"] == "stall":
            stall[int(names[e["pid"]].removeprefix("DP rank "))] += e["dur"]
    for rank, rows in steps.groupby("rank"):
        assert count[rank] == len(rows)  # one slice per step
        tolerance = len(rows) * 1e-6  # whole microseconds, one rounding per slice end
        assert abs(busy[rank] / 1e6 - rows["busy_s"].sum()) <= tolerance
        assert abs(stall[rank] / 1e6 - rows["stall_s"].sum()) <= 2 * tolerance


def test_every_call_has_its_slice_from_arrival_to_finish(run):
    _, _, _, result, doc = run
    slices = {e["args"]["request_id"]: e for e in doc["traceEvents"]
              if e["ph"] == "X" and e["cat"] == "request" and "request_id" in e["args"]}
    requests = result.requests
    assert set(slices) == set(requests["request_id"])
    for row in requests.itertuples():
        e = slices[row.request_id]
        assert e["ts"] == round(row.arrival_s * 1e6)
        assert e["args"]["completed"] == row.completed
        if row.completed:
            assert e["ts"] + e["dur"] == pytest.approx(row.finish_s * 1e6, abs=1)
            assert e["args"]["rank"] == row.rank


def test_phases_meet_the_request_timings(run):
    _, timeline, _, result, _ = run
    phases = timeline.phases()
    assert set(phases["phase"]) - {"request"} <= PHASES
    req = result.requests.set_index("request_id")
    first = phases[phases["stint"] == 0]
    admitted = req[req["first_scheduled_s"].notna()]
    queue = first[first["phase"] == "queue"].set_index("request_id")
    np.testing.assert_allclose(queue.loc[admitted.index, "start_s"], admitted["arrival_s"])
    np.testing.assert_allclose(queue.loc[admitted.index, "end_s"], admitted["first_scheduled_s"])
    # without preemption, decoding starts with the first token
    calm = req[req["completed"] & (req["preemptions"] == 0) & (req["output_tokens"] > 1)]
    decode = first[first["phase"] == "decode"].set_index("request_id")
    np.testing.assert_allclose(decode.loc[calm.index, "start_s"], calm["first_token_s"])
    np.testing.assert_allclose(decode.loc[calm.index, "end_s"], calm["finish_s"])
    # a preempted call queues once more than it was preempted... and is admitted again
    for rid, n in req.loc[req["preemptions"] > 0, "preemptions"].items():
        mine = phases[phases["request_id"] == rid]
        assert (mine["phase"] == "queue").sum() == n + 1
    # a fetched prefix is waited for inside the prefill of the call that fetched it
    fetched = req[req["fetched_tokens"] > 0].index
    waits = phases[phases["phase"] == "kv_fetch"]
    assert set(waits["request_id"]) == set(fetched)


def test_prefix_cache_counter_ends_at_the_summary_hit_rate(run):
    _, _, _, result, doc = run
    counter = [e for e in doc["traceEvents"] if e["ph"] == "C" and e["name"] == "prefix cache"]
    assert counter[-1]["args"]["hit rate"] == pytest.approx(
        result.summary["prefix_cache_hit_rate"], rel=1e-12)


def test_fast_forward_does_not_change_the_timeline():
    fast, slow = (replay(ff)[1] for ff in (True, False))
    assert fast.events == slow.events


def test_gantt_shows_the_latest_calls_and_says_how_many_it_leaves_out(run):
    _, timeline, gantt, result, _ = run
    gantt.flush()
    data = gantt.figure_data()
    order = timeline.phases().query("phase == 'request'").sort_values("order")["request_id"]
    assert data["calls"] == list(order)[-10:]
    assert data["total"] == len(result.requests)
    assert f"latest 10 of {len(result.requests)}" in gantt.figure.layout.title.text
    bars = {t.name: t for t in gantt.figure.data}
    rows = data["rows"]
    assert len(bars["decode"].y) == (rows["phase"] == "decode").sum()
    assert gantt.figure.layout.xaxis.title.text == "simulated time (s)"
    # as it was after the 50th step: nothing starts later, nothing outlives it
    early = gantt.phases(upto_step=50)
    t50 = np.sort((result.steps.drop_duplicates("step")["start_s"]
                   + result.steps.drop_duplicates("step")["duration_s"]).to_numpy())[49]
    assert early["end_s"].max() <= t50 + 1e-12
    assert len(early) < len(gantt.phases())


def test_cli_timeline_against_the_parquet_files_of_the_same_run(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    assert main(["trace", "gen", "--sessions", "2", "--seed", "3", "--out", str(trace)]) == 0
    capsys.readouterr()
    out, path = tmp_path / "run", tmp_path / "new" / "folder" / "timeline.json"
    assert main(["replay", "--trace", str(trace), "--model", "deepseek-v3", "--layout",
                 "dep8", "--concurrency", "2", "--duration-s", "60", "--max-model-len",
                 "1048576", "--out", str(out), "--timeline", str(path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    doc = json.loads(path.read_text())
    events = doc["traceEvents"]
    ranks = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert set(ranks.values()) == {f"DP rank {r}" for r in range(8)} | {"requests"}
    assert doc["otherData"]["layout"] == summary["layout"] == "dep8"
    steps = pd.read_parquet(out / "steps.parquet")
    for pid, name in ranks.items():
        if name == "requests":
            continue
        rows = steps[steps["rank"] == int(name.removeprefix("DP rank "))]
        busy = sum(e["dur"] for e in events if e["pid"] == pid and e.get("cat") == "step")
        assert abs(busy / 1e6 - rows["busy_s"].sum()) <= len(rows) * 1e-6
    requests = pd.read_parquet(out / "requests.parquet")
    calls = {e["args"]["request_id"]: e for e in events
             if e.get("cat") == "request" and "request_id" in e["args"]}
    for row in requests[requests["completed"]].itertuples():
        e = calls[row.request_id]
        assert e["ts"] == round(row.arrival_s * 1e6)
        assert abs(e["ts"] + e["dur"] - row.finish_s * 1e6) <= 1
