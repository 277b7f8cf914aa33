"""Run health: the summary says when a run's figures are about its edges (cold start,
calls cut off, a growing queue, few calls) — on a hand-worked table, then on runs
built to show each edge and on one that shows none."""

import math

import numpy as np
import pandas as pd

from labkit import Engine, Trace, TraceRequest, generate_agentx_trace
from labkit.engine.run_health import run_health


def table(rows):
    cols = ["request_id", "parent_id", "arrival_s", "first_scheduled_s", "completed",
            "computed_prefill_tokens"]
    return pd.DataFrame(rows, columns=cols)


def test_hand_worked_table():
    # D arrives before the window; C continues a call the run never sent (a part-way
    # start) and is still waiting at the end (t = 60)
    requests = table([
        ("A", None, 10.0, 10.5, True, 1000),
        ("B", "A", 20.0, 20.1, True, 100),
        ("C", "X", 10.0, math.nan, False, 3000),
        ("D", None, 5.0, 5.0, True, 5000),
    ])
    summary = {"requests_completed": 2, "ttft_p90_s": 1.0}
    h = run_health(requests, summary, warmup_s=8.0, end_s=60.0, closed_loop=True,
                   start_part_way=True)
    assert h["cold_start_prefill_share"] == (1000 + 3000) / 4100
    assert h["unfinished_share"] == 1 / 3
    assert (h["queued_at_end"], h["queue_wait_max_s"]) == (1, 50.0)
    text = " | ".join(h["warnings"])
    assert len(h["warnings"]) == 4
    for words in ("cold start: 98%", "part-way", "1 of 3 calls", "overload: 1 calls",
                  "waited longer than the reported TTFT p90 (1 s)", "only 2 calls"):
        assert words in text
    # the same table, open loop and well measured: nothing to say but the queue
    h = run_health(requests, {"requests_completed": 500, "ttft_p90_s": 60.0}, warmup_s=0.0,
                   end_s=60.0, closed_loop=False)
    assert h["cold_start_prefill_share"] is None
    assert h["unfinished_share"] == 1 / 4 and h["warnings"] == []


def agentx(sessions=8):
    return generate_agentx_trace(sessions, seed=4, block_size=16, context_window_tokens=200_000,
                                 compact_threshold_tokens=160_000)


def test_part_way_starts_are_flagged_turn_one_starts_are_not():
    trace = agentx()
    runs = {}
    for part_way in (True, False):
        engine = Engine("llama-3.1-8b", "tp1", "h200", max_model_len=1 << 18)
        runs[part_way] = engine.replay(trace, concurrency=8, duration_s=60,
                                       start_part_way=part_way)
    cold, warm = runs[True].summary, runs[False].summary
    assert cold["start_part_way"] and not warm["start_part_way"]
    # independent count: a session's first call in the run is the one whose parent
    # never ran; in a turn-one start that is the trace's first call of the session
    req = runs[False].requests
    firsts = req["parent_id"].isna()
    share = req.loc[firsts, "computed_prefill_tokens"].sum() / req["computed_prefill_tokens"].sum()
    assert warm["cold_start_prefill_share"] == share < 0.5
    assert cold["cold_start_prefill_share"] > 0.9
    assert any(w.startswith("cold start") for w in cold["warnings"])
    assert not any(w.startswith("cold start") for w in warm["warnings"])


def open_loop_trace(rate_per_s: float, seconds: float, prompt: int = 8000) -> Trace:
    n = int(rate_per_s * seconds)
    blocks = prompt // 16
    return Trace(16, [TraceRequest(f"s{i}", f"r{i}", None, "main", 0.0, prompt, 50,
                                   np.arange(i * blocks, (i + 1) * blocks, dtype=np.int64),
                                   timestamp=i / rate_per_s) for i in range(n)])


def test_a_growing_queue_is_flagged_a_sustainable_load_is_not():
    results = {}
    for rate in (200.0, 2.0):  # prompts of 8K tokens on one H200: ~20/s fit
        engine = Engine("llama-3.1-8b", "tp1", "h200")
        results[rate] = engine.replay(open_loop_trace(rate, 20.0), open_loop=True,
                                      duration_s=20.0).summary
    over, fine = results[200.0], results[2.0]
    assert over["queued_at_end"] > 1000 and over["queue_wait_max_s"] > over["ttft_p90_s"]
    assert any(w.startswith("overload") for w in over["warnings"])
    assert over["unfinished_share"] > 0.25
    assert fine["queued_at_end"] == 0 and fine["warnings"] == []
    assert fine["cold_start_prefill_share"] is None  # open loop: no sessions to start
