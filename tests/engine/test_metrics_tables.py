"""How the tables are built, checked against plain references: StepRecorder's steps
table (StepsCompleted chunks written into growing tables as they come, sorted at the
end) against one written row by row from the events; request rows' ITL
statistics (off one array, percentiles in numpy's steps) against numpy's calls on each
request's ITLs."""

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from labkit.engine.events import EventBus, StepsCompleted
from labkit.engine.itl_stats import ITLSamples, TokenGaps
from labkit.engine.metrics import STEP_COLUMNS, StepRecorder, _distinct, _pct, _pcts


def _event(rng, instance, ranks, first_step, t0):
    k, r = int(rng.integers(0, 5)), len(ranks)
    # now and then int32 counts: chunks of mixed dtypes promote as numpy does
    kind = np.int32 if rng.random() < 0.2 else np.int64
    ints = lambda: rng.integers(0, 50, size=(k, r)).astype(kind)  # noqa: E731
    busy = rng.random((k, r))
    duration = busy.max(axis=1) if k else np.zeros(0)
    # starts on a coarse grid, so different instances share start times (sort ties)
    start = t0 + np.round(rng.random(k) * 4) / 4
    used = ints()
    return StepsCompleted(
        t=float(t0), instance=instance, ranks=list(ranks),
        step_index=np.arange(first_step, first_step + k), start=start, duration=duration,
        busy=busy, stall=duration[:, None] - busy, compute=busy * 0.7, comm=busy * 0.2,
        num_prefill_reqs=ints(), num_decode_reqs=ints(), prefill_tokens=ints(),
        decode_tokens=ints(), kv_used_blocks=used,
        kv_total_blocks=rng.integers(50, 100, size=r),
        persistent_kv_bytes=used * 4096,  # ints, as the engine emits them
        temporary_kv_bytes=rng.random((k, r)) if rng.random() < 0.5 else np.zeros((k, r)))


def _naive(events) -> pd.DataFrame:
    rows = []
    for ev in events:
        for i in range(len(ev.step_index)):
            for j, rank in enumerate(ev.ranks):
                rows.append({
                    "step": ev.step_index[i], "instance": ev.instance, "rank": rank,
                    "start_s": ev.start[i], "duration_s": ev.duration[i],
                    "busy_s": ev.busy[i, j], "compute_s": ev.compute[i, j],
                    "comm_s": ev.comm[i, j], "stall_s": ev.stall[i, j],
                    "num_prefill_reqs": ev.num_prefill_reqs[i, j],
                    "num_decode_reqs": ev.num_decode_reqs[i, j],
                    "prefill_tokens": ev.prefill_tokens[i, j],
                    "decode_tokens": ev.decode_tokens[i, j],
                    "kv_used_blocks": ev.kv_used_blocks[i, j],
                    "kv_usage": ev.kv_used_blocks[i, j] / ev.kv_total_blocks[j],
                    "persistent_kv_bytes": float(ev.persistent_kv_bytes[i, j]),
                    "temporary_kv_bytes": float(ev.temporary_kv_bytes[i, j])})
    table = pd.DataFrame(rows, columns=STEP_COLUMNS)
    return table.sort_values(["start_s", "rank"], kind="stable", ignore_index=True)


def test_steps_table_equals_a_row_by_row_one():
    # instances of 1 to 4 ranks (numbered across the deployment); every instance as
    # wide (one rank: DP; several: lockstep DEP) or widths mixed (the table's three ways)
    # tables made for 1, 2, 7 or 512 rows at first (grown by one chunk, or doubled)
    for seed, widths in [(s, w) for s in range(20) for w in ("mixed", 1, 3)]:
        rng = np.random.default_rng(seed)
        capacity = int(rng.choice([1, 2, 7, 512]))
        layout, rank = [], 0
        for _ in range(int(rng.integers(1, 5))):
            width = int(rng.integers(1, 5)) if widths == "mixed" else widths
            layout.append(list(range(rank, rank + width)))
            rank += width
        bus = EventBus()
        recorder = StepRecorder(bus, capacity=capacity)
        events, next_step = [], [0] * len(layout)
        n_events = int(rng.integers(1, 30))
        early = None
        for n in range(n_events):
            if n == n_events // 2 and events:  # a table asked for part way: also right,
                early = recorder.frame()  # and changes nothing, nor do later events
                _check(early, events, (seed, widths))
                early_copy = early.copy()
                # a table is its user's to write into: the recorder does not see it
                written = recorder.frame()
                written.loc[:, ["busy_s", "rank"]] = -1
            i = int(rng.integers(0, len(layout)))
            # (starts anywhere: events come in commit order, not in start order)
            ev = _event(rng, i, layout[i], next_step[i], float(rng.integers(0, n_events)))
            next_step[i] += len(ev.step_index)
            bus.emit(ev)
            events.append(ev)
        got = recorder.frame()
        _check(got, events, (seed, widths))
        assert recorder.frame().equals(got)  # asked again: the same table
        assert early is None or early.equals(early_copy)  # the early one untouched
        assert recorder.num_events == len(events)


def _check(got: pd.DataFrame, events: list, case) -> None:
    want = _naive(events)
    assert list(got.columns) == STEP_COLUMNS
    assert isinstance(got.index, pd.RangeIndex) and got.index.equals(want.index)
    for c in STEP_COLUMNS:  # same values, same dtypes (floats: bit for bit)
        assert got[c].to_numpy().tobytes() == \
            want[c].to_numpy(dtype=got[c].dtype).tobytes(), (case, c)
    ints = {"step", "instance", "rank", "num_prefill_reqs", "num_decode_reqs",
            "prefill_tokens", "decode_tokens", "kv_used_blocks"}
    assert all(got[c].dtype == (np.int64 if c in ints else np.float64) for c in STEP_COLUMNS)
    assert len(got) == len(want) == sum(ev.busy.size for ev in events)


def test_counts_that_are_not_integers_are_refused():
    # the table keeps counts as int64: a float count would be cut, so it is an error
    bus = EventBus()
    recorder = StepRecorder(bus)
    events = (_event(np.random.default_rng(seed), 0, [0, 1], 0, 0.0) for seed in range(100))
    ev = next(e for e in events if len(e.step_index))
    ev.prefill_tokens = ev.prefill_tokens + 0.5
    with pytest.raises(TypeError, match="integers"):
        bus.emit(ev)
    assert recorder.num_rows == 0 and len(recorder.frame()) == 0


def test_no_steps_gives_the_empty_table():
    frame = StepRecorder(EventBus()).frame()
    assert list(frame.columns) == STEP_COLUMNS and len(frame) == 0


def test_itl_stats_equal_numpy_per_request():
    # every request's ITL statistics off the one array (one at a time, and all at once:
    # `all_stats`), against numpy's own calls on each request's list: lengths 0 to
    # 20000 (numpy sums in blocks of 8 and 128, and halves above), ties, spreads from
    # us to ks, zeros, non-finite
    rng = np.random.default_rng(0)
    requests = []
    lengths = [0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 16, 17, 64, 99, 100, 101, 127, 128, 129,
               136, 255, 256, 257, 1000, 1031, 9000, 20000]
    for n in lengths * 12:
        itl = rng.exponential(0.02, size=n) * rng.choice([1e-3, 1.0, 1e3])
        if n > 3 and rng.random() < 0.3:  # steps of one length: many equal gaps
            itl = np.round(itl, 3)
        if n > 1 and rng.random() < 0.05:
            itl[int(rng.integers(0, n))] = rng.choice([np.nan, np.inf, -np.inf, 0.0])
        requests.append(SimpleNamespace(itl=_recorded(itl, rng), gaps=itl))
    samples = ITLSamples(requests)
    with np.errstate(invalid="ignore"):
        every = np.array(samples.all_stats(), dtype=float).T
    for i, r in enumerate(requests):
        with np.errstate(invalid="ignore"):  # numpy's warnings on infinite gaps
            got = np.array(samples.stats(i), dtype=float)
            itl = r.gaps
            want = np.array([itl.mean(), *np.percentile(itl, (50, 90)), itl.max()]) \
                if len(itl) else np.full(4, np.nan)
        assert got.tobytes() == want.tobytes(), (i, len(itl))
        assert every[i].tobytes() == want.tobytes(), (i, len(itl))
    keep = [bool(k) for k in rng.random(len(requests)) < 0.5]
    want = np.concatenate([r.gaps for r, k in zip(requests, keep) if k])
    assert samples.where(keep).tobytes() == want.tobytes()


def _recorded(gaps: np.ndarray, rng) -> TokenGaps:
    """`gaps` recorded as a replay records them: single gaps (Python floats) and runs
    of them (read-only arrays, as a fast-forwarded run hands out), in random pieces."""
    recorded, at = TokenGaps(), 0
    while at < len(gaps):
        n = int(rng.integers(0, 6)) if rng.random() < 0.5 else 1
        if n == 1 and rng.random() < 0.7:
            recorded.append(float(gaps[at]))
        else:
            run = gaps[at : at + n].copy()
            run.flags.writeable = False
            recorded.extend(run)
        at += n
    return recorded


def test_token_gaps_read_as_the_list_of_gaps_recorded():
    rng = np.random.default_rng(5)
    for n in [0, 1, 2, 7, 50]:
        gaps = rng.exponential(0.01, size=n)
        recorded = _recorded(gaps, rng)
        assert len(recorded) == n
        assert recorded.values().tobytes() == gaps.tobytes()
        assert np.asarray(recorded).tobytes() == gaps.tobytes()
        assert list(recorded) == gaps.tolist()
        assert sum(recorded) == pytest.approx(gaps.sum())
        # single gaps alone (a request that ran step by step), laid out between others
        singles = TokenGaps()
        for gap in gaps.tolist():
            singles.append(gap)
        out = np.full(n + 2, -1.0)
        assert singles.lay_out(out, 1) == n + 1
        assert out[1:-1].tobytes() == gaps.tobytes() and out[0] == out[-1] == -1.0
    # a run's gaps are held by reference, and its values are read when asked for
    recorded, run = TokenGaps(), np.array([0.5, 0.25])
    recorded.append(1.0)
    recorded.extend(run)
    recorded.extend([])
    recorded.extend([0.125])
    assert list(recorded) == [1.0, 0.5, 0.25, 0.125] and len(recorded) == 4


def test_percentiles_taken_together_equal_each_alone():
    rng = np.random.default_rng(7)
    for n in [0, 1, 2, 5, 100, 10_001]:
        values = rng.exponential(0.02, size=n)
        if n > 2:
            values[rng.integers(0, n, size=2)] = np.nan
        qs = (50, 90, 99)
        got = np.array(_pcts(values, qs))
        assert got.tobytes() == np.array([_pct(values, q) for q in qs]).tobytes(), n
    assert np.isnan(_pcts([np.nan], (50, 90))).all()


def test_distinct_counts_equal_pandas_nunique():
    rng = np.random.default_rng(8)
    columns = [pd.Series(rng.integers(0, 50, 1000)), pd.Series(rng.integers(-7, 3, 99)),
               pd.Series(rng.integers(0, 2**62, 100)),  # too sparse to count by value
               pd.Series(np.array([5], dtype=np.uint8)), pd.Series([], dtype=np.int64),
               pd.Series([1.5, 1.5, np.nan, 2.0]), pd.Series([3, None, 3], dtype="Int64")]
    for column in columns:
        assert _distinct(column) == column.nunique()
