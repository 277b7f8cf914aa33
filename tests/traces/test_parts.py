"""Parts of a trace (`labkit.traces.parts`): windows, samples and a faster clock keep
whole sessions, move times as they claim, and refuse what would select nothing."""
from __future__ import annotations

import numpy as np
import pytest
from trace_helpers import naive_prefix_reuse, req

from labkit.cli import main
from labkit.errors import ConfigError
from labkit.traces import (
    Trace, generate_agentx_trace, generate_multi_turn_trace, load_trace, select)

def _sessions_trace() -> Trace:
    """Four sessions: their calls' timestamps, a later call of `b` past 30 s, and the
    session `c` whose calls are listed out of time order (its earliest is 12 s)."""
    bs = 4
    return Trace(bs, [
        req("a1", 8, [1, 2], session="a", timestamp=2.0),
        req("b1", 8, [3, 4], session="b", timestamp=10.0),
        req("a2", 12, [1, 2, 5], session="a", parent="a1", timestamp=11.0),
        req("c1", 4, [6], session="c", timestamp=14.0),
        req("c2", 8, [6, 7], session="c", parent="c1", timestamp=12.0),
        req("b2", 12, [3, 4, 8], session="b", parent="b1", timestamp=35.0),
        req("d1", 4, [9], session="d", timestamp=30.0),
    ])


def _by_hand_window(trace: Trace, start: float, end: float) -> dict[str, float]:
    """request id -> new timestamp, from the definition: a session is kept when its
    earliest call is in [start, end); every kept time moves `start` earlier."""
    out = {}
    for session in trace.sessions():
        if start <= min(r.timestamp for r in session) < end:
            out.update({r.request_id: r.timestamp - start for r in session})
    return out


@pytest.mark.parametrize("window", [(0.0, 100.0), (5.0, 30.0), (10.0, 13.0), (12.0, 12.5),
                                    (29.0, 31.0)])
def test_window_keeps_whole_sessions_that_start_in_it(window):
    trace = _sessions_trace()
    before = [(r.request_id, r.timestamp) for r in trace.requests]
    part = select(trace, window=window)
    expected = _by_hand_window(trace, *window)
    assert {r.request_id: r.timestamp for r in part.requests} == expected
    # file order kept, parents kept, the input trace untouched
    order = [r.request_id for r in trace.requests if r.request_id in expected]
    assert [r.request_id for r in part.requests] == order
    assert all(r.parent_id is None or r.parent_id in expected for r in part.requests)
    assert [(r.request_id, r.timestamp) for r in trace.requests] == before


def test_window_keeps_later_calls_past_its_end_and_prefix_reuse():
    trace = _sessions_trace()
    part = select(trace, window=(9.0, 11.0))  # session b only; b2 arrives at 35 - 9
    assert select(trace, window="9:11").requests == part.requests  # as text too
    assert select(trace, window="29:").requests == select(trace, window=(29, 1e9)).requests
    with pytest.raises(ConfigError, match=r"window '9': give START:END"):
        select(trace, window="9")
    assert [(r.request_id, r.timestamp) for r in part.requests] == [("b1", 1.0), ("b2", 26.0)]
    assert np.array_equal(part.request("b2").hash_ids, trace.request("b2").hash_ids)
    kept = [r for r in trace.requests if r.session_id == "b"]
    assert naive_prefix_reuse(part.requests, 4) == naive_prefix_reuse(kept, 4) == 8 / 20


def test_sample_draws_whole_sessions_by_seed():
    trace = generate_multi_turn_trace(200, turns=3, request_rate=5.0, seed=2, block_size=16)
    ids = [s[0].session_id for s in trace.sessions()]
    part = select(trace, sample=0.1, seed=7)
    kept = [s[0].session_id for s in part.sessions()]
    assert len(kept) == 20 and len(set(kept)) == 20
    assert kept == sorted(kept, key=ids.index)           # file order
    for s in part.sessions():                            # every call of a kept session
        assert [r.request_id for r in s] == \
            [r.request_id for r in trace.requests if r.session_id == s[0].session_id]
    assert [s[0].session_id for s in select(trace, sample=0.1, seed=7).sessions()] == kept
    assert [s[0].session_id for s in select(trace, sample=0.1, seed=8).sessions()] != kept
    assert len(select(trace, sample=1e-9).sessions()) == 1    # at least one
    # a sample of a closed-loop trace (no times) is allowed; its calls are unchanged
    agentx = generate_agentx_trace(6, seed=1)
    half = select(agentx, sample=0.5)
    assert len(half.sessions()) == 3
    assert all(r == agentx.request(r.request_id) for r in half.requests)


def test_speedup_scales_the_request_rate():
    trace = generate_multi_turn_trace(400, turns=2, request_rate=4.0, seed=3, block_size=16)
    fast = select(trace, speedup=2.5)
    starts = np.array([s[0].timestamp for s in trace.sessions()])
    fast_starts = np.array([s[0].timestamp for s in fast.sessions()])
    assert np.array_equal(fast_starts, starts / 2.5)
    rate = (len(starts) - 1) / (starts[-1] - starts[0])
    fast_rate = (len(starts) - 1) / (fast_starts[-1] - fast_starts[0])
    assert fast_rate == pytest.approx(2.5 * rate, rel=1e-12)
    # think times (closed-loop gaps of later turns) stay
    assert [r.delay_s for r in fast.requests] == [r.delay_s for r in trace.requests]


def test_cuts_compose_window_then_sample_then_speedup():
    trace = generate_multi_turn_trace(300, turns=2, request_rate=10.0, seed=5, block_size=16)
    part = select(trace, window=(5.0, 20.0), sample=0.5, speedup=2.0, seed=1)
    by_hand = select(select(select(trace, window=(5.0, 20.0)), sample=0.5, seed=1),
                     speedup=2.0)
    assert part.requests == by_hand.requests
    in_window = sum(5.0 <= s[0].timestamp < 20.0 for s in trace.sessions())
    starts = [s[0].timestamp for s in part.sessions()]
    assert len(starts) == round(0.5 * in_window) and 0 <= min(starts) and max(starts) < 7.5


@pytest.mark.parametrize(("knobs", "pattern"), [
    (dict(window=(40.0, 50.0)), r"window \[40, 50\) s holds no session: this trace's 4 "
                                r"sessions start between 2 and 30 s"),
    (dict(window=(5.0, 5.0)), r"window \[5, 5\): needs \(start, end\) with 0 <= start < end"),
    (dict(window=(-1.0, 5.0)), r"window \[-1, 5\): needs \(start, end\) with 0 <= start"),
    (dict(sample=0.0), r"sample 0: a fraction of the sessions, in \(0, 1\]"),
    (dict(sample=1.5), r"sample 1.5"),
    (dict(speedup=0.0), r"speedup 0: a ratio > 0"),
    (dict(speedup=float("inf")), r"speedup inf"),
    # from Python, any type: a ConfigError, not a TypeError
    (dict(sample="0.1"), r"sample '0.1': a fraction"),
    (dict(speedup=None, sample=float("nan")), r"sample nan: a fraction"),
    (dict(window=(1.0, 2.0, 3.0)), r"window \(1.0, 2.0, 3.0\): needs \(start, end\)"),
    (dict(window=("a", 3)), r"window \('a', 3\): needs"),
    (dict(seed=-1), r"seed=-1 must be >= 0"),
])
def test_bad_selections_are_named(knobs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        select(_sessions_trace(), **knobs)


def test_closed_loop_traces_have_no_window_nor_clock():
    agentx = generate_agentx_trace(2, seed=0)
    with pytest.raises(ConfigError, match="window needs arrival times"):
        select(agentx, window=(0.0, 10.0))
    with pytest.raises(ConfigError, match="speedup scales arrival times"):
        select(agentx, speedup=2.0)


def test_cli_cuts_a_published_trace(tmp_path, capsys):
    source = tmp_path / "azure.csv"  # the 2024 schema, six calls over 9.5 s
    source.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2024-05-10 00:00:{t:09.6f}+00:00,{100 * (i + 1)},{i + 1}\n"
        for i, t in enumerate([0.25, 1.5, 2.0, 4.75, 8.0, 9.75])))
    whole = load_trace(source)
    out = tmp_path / "part.jsonl"
    times = sorted(r.timestamp for r in whole.requests)
    start, end = times[1], times[-1]  # drops the first and the last row
    assert main(["trace", "convert", str(source), str(out), "--window", f"{start}:{end}",
                 "--speedup", "2"]) == 0
    part = load_trace(out)
    assert sorted(r.timestamp for r in part.requests) == \
        [(t - start) / 2 for t in times[1:-1]]
    capsys.readouterr()
    assert main(["trace", "stats", str(source), "--window", ":0.5", "--json"]) == 0
    assert '"requests": %d' % sum(t < 0.5 for t in times) in capsys.readouterr().out
    # bad flags: refused before anything is read or written
    for flags, message in [(["--window", "5"], "--window '5': give START:END"),
                           (["--sample-sessions", "2"], "--sample-sessions 2: a fraction"),
                           (["--speedup", "-1"], "--speedup -1: a ratio > 0")]:
        bad = tmp_path / "bad.jsonl"
        assert main(["trace", "convert", str(source), str(bad), *flags]) == 2
        assert message in capsys.readouterr().err and not bad.exists()


def test_replay_of_a_window_is_the_replay_of_that_part(tmp_path, capsys):
    import json

    from labkit.traces import generate_random_trace, write_trace

    source, part = tmp_path / "load.jsonl", tmp_path / "part.jsonl"
    write_trace(generate_random_trace(num_prompts=60, request_rate=6.0, input_len=300,
                                      output_len=20, seed=4), source)
    flags = ["--window", "3:6", "--speedup", "1.5"]
    assert main(["trace", "convert", str(source), str(part), *flags]) == 0
    summaries = []
    for trace, more in [(source, flags), (part, [])]:
        capsys.readouterr()
        assert main(["replay", "--trace", str(trace), *more, "--model", "llama-3.1-8b",
                     "--open-loop", "--json", "--no-progress"]) == 0
        summary = json.loads(capsys.readouterr().out)
        summary.pop("wall_s"), summary.pop("sim_speed")
        summaries.append(summary)
    assert summaries[0] == summaries[1]
    in_window = sum(3 <= r.timestamp < 6 for r in load_trace(source).requests)
    assert summaries[0]["requests_completed"] == in_window > 0
