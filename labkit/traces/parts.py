"""Parts of a trace: a time window, a sample of sessions, a faster clock.

Published traces are large: BurstGPT holds 1.4M-5.3M requests over two months, the
2024 Azure traces a week, a Bailian trace hours. A simulation asks for a part of one
-- the busiest hour, one session in ten, the same traffic at twice the rate -- as
trace-replay benchmarks ask of theirs (AIPerf's fixed-schedule start and end offsets,
the Mooncake synthesizer's speedup ratio). Three cuts, each on whole **sessions**, so
that every kept call keeps its parent and the prefix reuse within a session:

* ``window=(start_s, end_s)``: the sessions whose earliest call arrives in
  ``[start_s, end_s)`` of trace time, their timestamps moved ``start_s`` earlier (the
  window starts at 0). A kept session's later calls stay, even past ``end_s``. Only
  for traces with arrival times (open loop: every session's first call has one).
* ``sample=f``: ``round(f * sessions)`` sessions (at least one) drawn at random
  (``seed``), kept in file order.
* ``speedup=r``: timestamps divided by ``r`` -- ``r`` times the request rate, gaps
  within a session as short. Closed-loop think times (``delay_s``) stay.

They compose in that order (a window of the trace's own time, then a sample, then a
faster clock). What is not chosen is dropped, never changed; a selection that keeps
nothing is an error naming the cut and what the trace holds.
"""
from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from labkit import checks
from labkit.errors import ConfigError
from labkit.traces.collector import collector_paused
from labkit.traces.schema import Trace


def select(trace: Trace, window: tuple[float, float] | str | None = None,
           sample: float | None = None, speedup: float | None = None,
           seed: int = 0) -> Trace:
    """A new trace of the chosen sessions (see the module docstring); ``trace``
    itself is left as it was. ``window`` also as text, ``"3600:7200"`` (``parse_window``).
    ConfigError for a bad knob or an empty selection."""
    if isinstance(window, str):
        window = parse_window(window, "window")
    check_selection(window, sample, speedup)
    checks.integer("seed", seed, low=0)
    sessions = trace.sessions()
    if window is not None:
        sessions = _in_window(sessions, *window)
    if sample is not None:
        keep = max(1, round(sample * len(sessions)))
        chosen = np.random.default_rng(seed).choice(len(sessions), keep, replace=False)
        sessions = [sessions[i] for i in sorted(chosen)]
    shift = window[0] if window is not None else 0.0
    rate = speedup if speedup is not None else 1.0
    if speedup is not None and not any(r.timestamp is not None for s in sessions for r in s):
        raise ConfigError("speedup scales arrival times, and this trace has none (closed-loop "
                          "sessions arrive as others finish: raise the concurrency instead)")
    kept = {id(r) for s in sessions for r in s}
    with collector_paused():  # (a copy of each kept call, no cycles: `collector.py`)
        requests = [_moved(r, shift, rate) for r in trace.requests if id(r) in kept]
        return Trace(trace.block_size, requests, source=trace.source, format=trace.format)


PYTHON_NAMES = ("window", "sample", "speedup")
FLAG_NAMES = ("--window", "--sample-sessions", "--speedup")


def check_selection(window, sample, speedup, names=PYTHON_NAMES) -> None:
    """ConfigError naming the first bad knob (as ``names`` spell them), before
    anything is read."""
    if window is not None:
        pair = tuple(window) if isinstance(window, (tuple, list)) else ()
        if len(pair) != 2 or not all(_real(x) for x in pair) or not (
                math.isfinite(pair[0]) and 0 <= pair[0] < pair[1]):
            raise ConfigError(f"{names[0]} {_spelt(window)}: needs (start, end) with 0 <= "
                              f"start < end seconds of trace time")
    if sample is not None and not (_real(sample) and 0 < sample <= 1):
        raise ConfigError(f"{names[1]} {_spelt(sample)}: a fraction of the sessions, in "
                          f"(0, 1]")
    if speedup is not None and not (_real(speedup) and math.isfinite(speedup) and speedup > 0):
        raise ConfigError(f"{names[2]} {_spelt(speedup)}: a ratio > 0 (2 = twice the "
                          f"request rate)")


def _real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and not math.isnan(x)


def _spelt(value) -> str:
    """A knob's value in a message: numbers as %g, a window as [start, end)."""
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(map(_real, value)):
        return f"[{value[0]:g}, {value[1]:g})"
    return f"{value:g}" if _real(value) else repr(value)


def add_trace_flags(parser) -> None:
    """``--format`` and the flags of a part of the trace (``load_selected`` reads them)."""
    from labkit.traces.formats import FORMATS

    parser.add_argument("--format", choices=["auto", *FORMATS], default="auto",
                        help="the trace file's format (default: told from its first line)")
    group = parser.add_argument_group("a part of the trace (whole sessions, see "
                                      "labkit.traces.parts; --where: rows, row_filter)")
    group.add_argument("--window", metavar="START:END",
                       help="sessions starting in this span of trace seconds (3600:7200, "
                            "3600:, :600), moved to start at 0")
    group.add_argument("--sample-sessions", type=float, metavar="FRACTION",
                       help="this fraction of the sessions, drawn at random")
    group.add_argument("--speedup", type=float, metavar="RATIO",
                       help="arrival times divided by RATIO (2: twice the request rate)")
    group.add_argument("--sample-seed", type=int, default=0, metavar="N",
                       help="seed of --sample-sessions (default 0)")
    group.add_argument("--where", action="append", metavar="CONDITION",
                       help="only the rows meeting it (CSV, Mooncake, Bailian traces), e.g. "
                            "'Model=GPT-4', 'Response tokens>0', 'type=text' (=, !=, >, >=, "
                            "<, <=; repeat it: all must hold)")


def selection_from_args(args) -> dict | None:
    """The ``select`` knobs the flags give (checked, ``--where`` too: call it before
    loading), or None."""
    from labkit.traces.formats.row_filter import RowFilter

    RowFilter.parse(args.where)
    window = None if args.window is None else parse_window(args.window)
    if window is None and args.sample_sessions is None and args.speedup is None:
        return None
    check_selection(window, args.sample_sessions, args.speedup, FLAG_NAMES)
    return {"window": window, "sample": args.sample_sessions, "speedup": args.speedup,
            "seed": args.sample_seed}


def parse_window(text: str, name: str = "--window") -> tuple[float, float]:
    """``"START:END"`` in seconds, either side may be empty (``"3600:"``, ``":600"``);
    ``name``: how an error spells the knob."""
    start, sep, end = text.partition(":")
    try:
        if not sep:
            raise ValueError
        window = (float(start) if start.strip() else 0.0,
                  float(end) if end.strip() else math.inf)
    except ValueError:
        raise ConfigError(f"{name} {text!r}: give START:END in seconds of trace time, "
                          f"e.g. 3600:7200, 3600: or :600") from None
    check_selection(window, None, None, (name, *FLAG_NAMES[1:]))
    return window


def _in_window(sessions, start: float, end: float):
    starts = [min((r.timestamp for r in s if r.timestamp is not None), default=None)
              for s in sessions]
    if any(t is None for t in starts):
        raise ConfigError("a window needs arrival times, and this trace's sessions have none "
                          "(closed loop): sample sessions instead")
    kept = [s for s, t in zip(sessions, starts, strict=True) if start <= t < end]
    if not kept:
        raise ConfigError(f"window [{start:g}, {end:g}) s holds no session: this trace's "
                          f"{len(sessions)} sessions start between {min(starts):g} and "
                          f"{max(starts):g} s")
    return kept


def _moved(req, shift: float, rate: float):
    if req.timestamp is None:
        return dataclasses.replace(req)
    return dataclasses.replace(req, timestamp=(req.timestamp - shift) / rate)


def load_selected(path, args) -> Trace:
    """``load_trace(path, args.format, args.where)`` cut as the flags say (they are
    checked first; a CSV loader leaves out what the window will, `formats.load`); with
    ``--where``, how many rows it kept, on stderr."""
    import sys

    from labkit.traces.formats import load
    from labkit.traces.formats.row_filter import RowFilter

    knobs = selection_from_args(args)
    rows = RowFilter.parse(args.where)
    trace = load(path, args.format, window=knobs["window"] if knobs else None, where=rows)
    if rows is not None:  # (on stderr: what stdout prints, --json included, stays as it is)
        print(f"--where {rows}: {rows.kept_rows:,} of the {rows.seen:,} rows kept",
              file=sys.stderr)
    return trace if knobs is None else select(trace, **knobs)
