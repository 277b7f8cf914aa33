"""Requests that can never run: refused by default, skipped with on_oversize="skip" --
and what a skipped call does to its session (see labkit/engine/oversize.py)."""

from __future__ import annotations

import pandas as pd
import pytest

from labkit import Engine, Trace
from labkit.cli import main
from labkit.errors import ConfigError
from labkit.traces import TraceRequest, write_trace

BIG = 5000   # tokens: over max_model_len=4096


def call(rid, n, ids, session="A", parent=None, kind="main", delay=0.0, out=20, ts=None):
    return TraceRequest(session, rid, parent, kind, delay, n, out, ids, timestamp=ts)


def _ids(start: int, n_tokens: int) -> list[int]:
    return list(range(start, start + -(-n_tokens // 64)))


def agentic() -> Trace:
    """Session A: m1 spawns subagent s0 (too long) whose s1 follows; m2 (after m1,
    waiting for s1) fits; m3 is too long, m4 follows it. Session B fits."""
    return Trace(64, [
        call("m0", 600, _ids(0, 600)),
        call("m1", 900, _ids(0, 640) + _ids(100, 260), parent="m0", delay=1.0),
        call("s0", BIG, _ids(0, 640) + _ids(200, BIG - 640), parent="m1", kind="subagent"),
        call("s1", 800, _ids(300, 800), parent="s0", kind="subagent", delay=2.0),
        call("m2", 1200, _ids(0, 640) + _ids(100, 256) + _ids(400, 304), parent="m1",
             delay=0.5),
        call("m3", BIG, _ids(500, BIG), parent="m2"),
        call("m4", 700, _ids(600, 700), parent="m3"),
        call("b0", 500, _ids(700, 500), session="B"),
        call("b1", 900, _ids(700, 512) + _ids(800, 388), session="B", parent="b0", delay=1.0),
    ])


def engine() -> Engine:
    return Engine("llama-3.1-8b", "tp1", "h200", max_model_len=4096)


def test_error_is_the_default():
    with pytest.raises(ConfigError, match=r"request s0: 5000 \+ 20 tokens exceed "
                                          r"max_model_len=4096"):
        engine().replay(agentic(), concurrency=2, loop_trace=False)


def test_skip_in_a_closed_loop_ends_threads_not_the_main_agent():
    result = engine().replay(agentic(), concurrency=2, loop_trace=False,
                             start_part_way=False, on_oversize="skip")
    req = result.requests.set_index("request_id")
    skipped = req[req["skipped"]]
    assert sorted(skipped.index) == ["m3", "m4", "s0", "s1"]
    assert skipped.loc["s0", "skip_reason"].startswith("oversize: request s0: 5000 + 20")
    assert skipped.loc["s1", "skip_reason"] == "after skipped s0"
    assert skipped.loc["m4", "skip_reason"] == "after skipped m3"
    assert skipped["arrival_s"].isna().all() and not skipped["completed"].any()
    served = req[~req["skipped"]]
    assert sorted(served.index) == ["b0", "b1", "m0", "m1", "m2"]
    assert served["completed"].all()
    # m2 did not wait for the failed subagent: it left delay_s after m1 finished.
    assert served.loc["m2", "arrival_s"] == pytest.approx(served.loc["m1", "finish_s"] + 0.5)
    s = result.summary
    assert s["requests_skipped"] == 4 and s["requests_arrived"] == 5
    assert s["requests_completed"] == 5
    assert s["sessions_completed"] == 1      # B; A lost calls: not a whole task
    assert s["session_completion_p50_s"] == pytest.approx(
        served.loc["b1", "finish_s"] - served.loc["b0", "arrival_s"])


def test_skip_in_an_open_loop_drops_only_the_oversized_call():
    trace = Trace(64, [call("a", 600, _ids(0, 600), ts=0.0),
                       call("b", BIG, _ids(0, BIG), parent="a", ts=1.0),
                       call("c", 900, _ids(0, 900), parent="b", ts=2.0),   # own arrival
                       call("d", 900, _ids(900, 900), parent="b", kind="subagent")])
    result = engine().replay(trace, open_loop=True, on_oversize="skip")
    req = result.requests.set_index("request_id")
    assert sorted(req.index[req["skipped"]]) == ["b", "d"]   # d waits for b: gone too
    assert req.loc["c", "arrival_s"] == 2.0 and req.loc["c", "completed"]
    # every served call finished: none was queued or cut off (the skipped two were
    # counted as both, and could set off an overload warning)
    s = result.summary
    assert (s["queued_at_end"], s["unfinished_share"], s["queue_wait_max_s"]) == (0, 0.0, 0.0)
    assert not any("overload" in w or "finish" in w for w in s["warnings"])  # few calls: yes


def test_a_looped_closed_loop_passes_sessions_that_start_too_long():
    trace = Trace(64, [call("x0", BIG, _ids(0, BIG), session="X"),
                       call("y0", 500, _ids(100, 500), session="Y")])
    result = engine().replay(trace, concurrency=1, duration_s=5.0, on_oversize="skip")
    req = result.requests
    assert req["skipped"].sum() == result.summary["requests_skipped"] >= 2
    assert set(req.loc[~req["skipped"], "session_id"].str.split("@").str[0]) == {"Y"}
    assert req.loc[~req["skipped"], "completed"].sum() >= 2   # Y replayed again and again


def test_nothing_to_replay_is_an_error():
    trace = Trace(64, [call("x0", BIG, _ids(0, BIG)), call("x1", 100, _ids(0, 100),
                                                          parent="x0")])
    with pytest.raises(ConfigError, match="nothing to replay"):
        engine().replay(trace, concurrency=1, duration_s=5.0, on_oversize="skip")
    with pytest.raises(ConfigError, match="unknown on_oversize 'drop'; allowed: error, skip"):
        engine().replay(trace, concurrency=1, duration_s=5.0, on_oversize="drop")


def test_cli_lists_skipped_calls_in_requests_parquet(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    write_trace(agentic(), path)
    args = ["replay", "--trace", str(path), "--model", "llama-3.1-8b", "--concurrency", "2",
            "--no-loop-trace", "--no-start-part-way", "--max-model-len", "4096"]
    assert main(args) == 2
    assert "request s0: 5000 + 20 tokens exceed" in capsys.readouterr().err
    assert main(args + ["--on-oversize", "skip", "--out", str(tmp_path / "run")]) == 0
    assert "requests_skipped          4" in capsys.readouterr().out
    table = pd.read_parquet(tmp_path / "run" / "requests.parquet")
    assert table["skipped"].sum() == 4 and len(table) == 9


@pytest.mark.parametrize("seed", range(3))
def test_one_check_of_the_longest_call_answers_for_all_as_checking_each(seed):
    """`_all_fit` (the longest prompt with the longest total, checked once) says what
    checking every call says, on engines where each of check_fits' limits binds: the
    model length, the KV a rank holds (sliding windows too), a prompt that cannot be
    chunked; and P/D pairs."""
    import numpy as np

    from labkit.engine.disagg import PDEngine
    from labkit.engine.oversize import _all_fit

    engines = [
        Engine("llama-3.1-8b", "tp1", "h200", max_model_len=4096),
        Engine("llama-3.1-8b", "tp1", "h200", num_gpu_blocks_override=200),
        Engine("gpt-oss-120b", "tp1", "h200", num_gpu_blocks_override=300),
        Engine("llama-3.1-8b", "tp1", "h200", enable_chunked_prefill=False,
               max_num_batched_tokens=3000),
        PDEngine("llama-3.1-8b", "tp1", "tp1", max_model_len=4096),
    ]
    rng = np.random.default_rng(seed)
    verdicts = []
    for eng in engines:
        for _ in range(40):
            n = int(rng.integers(1, 6))
            calls = [call(f"r{i}", int(rng.integers(1, 5000)), [], out=int(rng.integers(1, 2000)))
                     for i in range(n)]
            each = True
            for tr in calls:
                try:
                    eng.check_fits(tr.request_id, tr.input_length, tr.output_length)
                except ConfigError:
                    each = False
            assert _all_fit(eng, calls) == each
            verdicts.append(each)
    assert 0.2 < sum(verdicts) / len(verdicts) < 0.8  # both answers are exercised
