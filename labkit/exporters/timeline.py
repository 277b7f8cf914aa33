"""The timeline of a run, as Chrome / Perfetto trace-event JSON.

`TimelineRecorder(engine)` subscribes to an engine's events before it runs; afterwards
`save("run.json")` writes the run in the *trace event format* that ui.perfetto.dev and
chrome://tracing open (a `.json.gz` name is gzipped; both tools read that too):

- one process per DP rank, `DP rank r`, whose `steps` thread has a slice per step:
  the rank's own work (`busy`: compute + communication + overhead), named by what it
  did (`prefill`, `decode`, `prefill+decode`, `idle` for a lockstep dummy step), with
  its tokens, requests and stall in `args`, then a `stall` slice while it waited for
  the slowest rank of a lockstep (DEP) step; and a `KV cache` counter (GiB of KV per
  GPU, and the share of the rank's blocks in use), sampled when it changes;
- one `requests` process with a thread per call (in arrival order) holding a slice
  from arrival to finish, nested in it the call's `queue`, `prefill` (with its
  `chunk`s and any `kv_fetch` / `kv_load` wait) and `decode` phases
  (`request_phases.py`), and a `prefix cache` counter: the token-weighted hit rate of
  the calls admitted so far, whose last value is the summary's
  `prefix_cache_hit_rate`.

The format (the "Trace Event Format" document of the Chromium project): a JSON object
whose `traceEvents` list holds events with `ph` "X" (a complete slice: `ts` and `dur`),
"C" (a counter: `args` maps series to values) and "M" (metadata: process and thread
names and sort order), each with `pid` and `tid`. Times are microseconds; we write
whole microseconds, because the viewers turn fractional ones into nanoseconds by
truncation, which can push a child slice a nanosecond past its parent. The optional
`displayTimeUnit` is left out: Perfetto's JSON importer has read it as the unit of
the timestamps themselves.

The same events are `recorder.events` (a list of dicts) and `recorder.frame()` (a
DataFrame); the request phases are `recorder.phases()`.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from labkit.engine.events import RequestScheduled, StepsCompleted
from labkit.exporters.request_phases import RequestPhases

GIB = float(1 << 30)
STEP_FIELDS = ("busy", "stall", "compute", "comm", "num_prefill_reqs", "num_decode_reqs",
               "prefill_tokens", "decode_tokens", "kv_used_blocks", "persistent_kv_bytes")


def _us(seconds) -> np.ndarray:
    """Whole microseconds (see the module docstring)."""
    return np.rint(np.asarray(seconds, dtype=float) * 1e6).astype(np.int64)


class TimelineRecorder:
    """Records a run's steps, calls and counters; writes them as trace-event JSON."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.ranks = [r for inst in engine.instances for r in inst.ranks]
        self.request_phases = RequestPhases(engine)
        self._steps: list[dict] = []  # one entry per StepsCompleted, columns per rank
        self._hits: list[tuple] = []  # (t, hit rate so far)
        self._admitted: set[str] = set()
        self._cached = self._prompt = 0
        self._subs = [
            engine.events.subscribe(self._on_steps, StepsCompleted),
            engine.events.subscribe(self._on_scheduled, RequestScheduled),
            engine.events.subscribe(self.request_phases.on_event, *RequestPhases.KINDS),
        ]

    def detach(self) -> None:
        for sub in self._subs:
            sub.unsubscribe()

    # ------------------------------------------------------------------ events
    def _on_steps(self, ev: StepsCompleted) -> None:
        chunk = {"ranks": list(ev.ranks), "step": ev.step_index, "start": ev.start,
                 "duration": ev.duration, "total": ev.kv_total_blocks}
        for name in STEP_FIELDS:
            chunk[name] = np.asarray(getattr(ev, name))
        self._steps.append(chunk)

    def _on_scheduled(self, ev: RequestScheduled) -> None:
        # as the summary counts it: each call once, at its first admission
        if ev.request_id in self._admitted:
            return
        self._admitted.add(ev.request_id)
        self._cached += ev.num_cached_tokens
        self._prompt += ev.num_prompt_tokens
        self._hits.append((ev.t, self._cached / self._prompt if self._prompt else 0.0))

    # ------------------------------------------------------------------ output
    def phases(self) -> pd.DataFrame:
        """The calls' phases (`RequestPhases.frame`): one row per interval."""
        return self.request_phases.frame()

    @property
    def events(self) -> list[dict]:
        """The trace events of the run so far (metadata first, then by time)."""
        pid_requests = len(self.ranks) + 1
        # process-level metadata sits on the process's own main thread (tid = pid)
        meta = [_meta("process_name", pid_requests, pid_requests, name="requests"),
                _meta("process_sort_index", pid_requests, pid_requests,
                      sort_index=len(self.ranks))]
        for i, rank in enumerate(self.ranks):
            meta += [_meta("process_name", rank + 1, rank + 1, name=f"DP rank {rank}"),
                     _meta("process_sort_index", rank + 1, rank + 1, sort_index=i),
                     _meta("thread_name", rank + 1, rank + 1, name="steps")]
        threads, calls = self._request_events(pid_requests)
        meta += threads
        timed = self._step_events() + calls
        timed += [{"ph": "C", "name": "prefix cache", "pid": pid_requests, "tid": pid_requests,
                   "ts": int(_us(t)), "args": {"hit rate": rate}} for t, rate in self._hits]
        # by time; at equal times longer slices first, so parents open before children
        timed.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        return meta + timed

    def _step_events(self) -> list[dict]:
        """Per rank: a busy slice and a stall slice per step, KV counter on change."""
        out, kv_shown = [], {}
        for chunk in self._steps:
            start = _us(chunk["start"])
            busy_end = _us(chunk["start"][:, None] + chunk["busy"])
            end = _us(chunk["start"] + chunk["duration"])
            for j, rank in enumerate(chunk["ranks"]):
                for k in range(len(start)):
                    out += _step_slices(chunk, k, j, rank + 1, start[k], busy_end[k, j], end[k])
                    used = int(chunk["kv_used_blocks"][k, j])
                    if kv_shown.get(rank) != used:
                        kv_shown[rank] = used
                        gib = float(chunk["persistent_kv_bytes"][k, j]) / GIB
                        out.append({"ph": "C", "name": "KV cache", "pid": rank + 1,
                                    "tid": rank + 1, "ts": int(start[k]), "args": {
                                        "GiB per GPU": gib,
                                        "usage": used / max(int(chunk["total"][j]), 1)}})
        return out

    def _request_events(self, pid: int) -> tuple[list[dict], list[dict]]:
        """Thread metadata (a thread per call) and the calls' slices."""
        frame = self.phases()
        meta, out = [], []
        base = pid + 1  # thread ids are unique across processes (Perfetto wants that)
        for row in frame.itertuples(index=False):
            tid = base + int(row.order)
            start, end = int(_us(row.start_s)), int(_us(row.end_s))
            if row.phase == "request":
                meta += [_meta("thread_name", pid, tid, name=row.request_id),
                         _meta("thread_sort_index", pid, tid, sort_index=int(row.order))]
                args = {"request_id": row.request_id, "session_id": row.session_id,
                        "rank": int(row.rank), "completed": bool(row.completed)}
            elif end <= start:
                continue  # nothing to see at a microsecond's resolution
            else:
                args = {"admission": int(row.stint)}
            out.append({"ph": "X", "cat": "request", "name": row.phase if row.phase != "request"
                        else row.request_id, "pid": pid, "tid": tid, "ts": start,
                        "dur": max(end - start, 0), "args": args})
        return meta, out

    def frame(self) -> pd.DataFrame:
        """The trace events as a table: ph, name, cat, pid, tid, ts_us, dur_us, args."""
        rows = [{"ph": e["ph"], "name": e["name"], "cat": e.get("cat", ""), "pid": e["pid"],
                 "tid": e["tid"], "ts_us": e.get("ts", 0), "dur_us": e.get("dur", 0),
                 "args": e.get("args", {})} for e in self.events]
        return pd.DataFrame(rows, columns=["ph", "name", "cat", "pid", "tid", "ts_us",
                                           "dur_us", "args"])

    def to_json(self) -> dict:
        """The whole document: `traceEvents` plus what run it is (`otherData`)."""
        e = self.engine
        # no "displayTimeUnit": some Perfetto versions read it as the unit of `ts`
        return {"traceEvents": self.events,
                "otherData": {"model": e.model.name, "layout": e.layout.text,
                              "hardware": e.hardware.name, "backend": e.backend,
                              "clock": "simulated seconds from the start of the run"}}

    def save(self, path: str | os.PathLike) -> Path:
        """Write the timeline (gzipped if `path` ends in .gz), atomically, creating
        missing folders. Returns the path."""
        target = Path(path)
        # raw UTF-8, no \u escapes: Perfetto's JSON tokenizer does not read those
        data = json.dumps(self.to_json(), separators=(",", ":"), ensure_ascii=False).encode()
        if target.name.endswith(".gz"):
            data = gzip.compress(data, mtime=0)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.",
                                       suffix=".tmp")
        except OSError as err:
            raise OSError(f"cannot write {path}: {err.strerror}") from None
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o644)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return target


def _step_slices(chunk: dict, k: int, j: int, pid: int, start: int, busy_end: int,
                 end: int) -> list[dict]:
    """Step k of rank column j: its own work, then its stall (if it waited)."""
    prefill, decode = int(chunk["prefill_tokens"][k, j]), int(chunk["decode_tokens"][k, j])
    name = ("prefill+decode" if prefill and decode else "prefill" if prefill
            else "decode" if decode else "idle")
    stall = float(chunk["stall"][k, j])
    out = [{"ph": "X", "cat": "step", "name": name, "pid": pid, "tid": pid, "ts": int(start),
            "dur": int(busy_end - start),
            "args": {"step": int(chunk["step"][k]), "prefill_tokens": prefill,
                     "decode_tokens": decode,
                     "prefill_requests": int(chunk["num_prefill_reqs"][k, j]),
                     "decode_requests": int(chunk["num_decode_reqs"][k, j]),
                     "busy_ms": 1e3 * float(chunk["busy"][k, j]),
                     "compute_ms": 1e3 * float(chunk["compute"][k, j]),
                     "comm_ms": 1e3 * float(chunk["comm"][k, j]), "stall_ms": 1e3 * stall}}]
    if stall > 0 and end > busy_end:
        out.append({"ph": "X", "cat": "stall", "name": "stall", "pid": pid, "tid": pid,
                    "ts": int(busy_end), "dur": int(end - busy_end),
                    "args": {"stall_ms": 1e3 * stall}})
    return out


def _meta(kind: str, pid: int, tid: int, **args) -> dict:
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": args}
