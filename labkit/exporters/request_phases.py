"""Request phases: each call's life, from its events, as time intervals.

A call waits in its rank's queue until the scheduler admits it, then prefills its
prompt in one or more chunks (one per step it computes in), then decodes until its
last token. Preemption sends it back to the queue; when it is admitted again it
recomputes what it lost (a prefill again, mostly from the prefix cache) and decodes
on. A call whose prefix comes from elsewhere (another rank's cache, the offload
tiers) holds its blocks while that KV arrives before its first chunk.

`RequestPhases` rebuilds exactly that from the event stream — `RequestArrived`,
`RequestScheduled`, `StepStarted` (which requests compute in each step), `KVFetched`
/ `KVLoaded` (the waits), `RequestPreempted`, `RequestFinished` — and reads one thing
off the engine's request objects: whether a request is decoding when a step starts
(the event lists the requests, not their role). It changes nothing.

Its `frame()` is one row per interval: the whole call (`request`), its `queue`,
`prefill` and `decode` phases, and inside a prefill its `chunk`s and `kv_wait`s.
Phases are nested: a chunk lies inside its prefill, a phase inside its call. Calls
still running are cut at `now`. Both the Perfetto timeline (`timeline.py`) and the
notebook Gantt view (`labkit.widgets.RequestGantt`) draw this table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from labkit.engine.events import (
    KVFetched, KVLoaded, RequestArrived, RequestFinished, RequestPreempted, RequestRouted,
    RequestScheduled, StepStarted,
)

PHASE_COLUMNS = ["request_id", "session_id", "rank", "order", "phase", "start_s", "end_s",
                 "completed", "stint"]


@dataclass(slots=True)
class _Stint:
    """One admission: from being scheduled to being preempted or finishing."""

    start: float
    end: float | None = None
    chunks: list = field(default_factory=list)  # (start, end) of its prefill steps
    decode_from: float | None = None  # start of its first decode step


@dataclass(slots=True)
class _Call:
    request_id: str
    session_id: str
    arrival: float
    order: int  # arrival order, from 0
    rank: int = -1
    finish: float | None = None
    stints: list = field(default_factory=list)
    requeued: list = field(default_factory=list)  # preemption times
    # (start, end, source) of prefix KV arriving from elsewhere; announced just before
    # the admission it belongs to
    waits: list = field(default_factory=list)


class RequestPhases:
    """Keeps every call's phases; feed it the events in `KINDS` via `on_event`."""

    KINDS = (RequestArrived, RequestRouted, RequestScheduled, RequestPreempted,
             RequestFinished, StepStarted, KVFetched, KVLoaded)

    def __init__(self, engine) -> None:
        self.engine = engine
        self.calls: dict[str, _Call] = {}

    # ------------------------------------------------------------------ events
    def on_event(self, ev) -> None:
        if isinstance(ev, StepStarted):
            self._step(ev)
        elif isinstance(ev, RequestArrived):
            self._call(ev.request_id, ev.t)
        elif isinstance(ev, RequestRouted):
            self._call(ev.request_id).rank = ev.rank
        elif isinstance(ev, RequestScheduled):
            call = self._call(ev.request_id)
            call.rank = ev.rank
            call.stints.append(_Stint(ev.t))
        elif isinstance(ev, (KVFetched, KVLoaded)):
            source = "fetch" if isinstance(ev, KVFetched) else "load"
            self._call(ev.request_id).waits.append((ev.t, ev.t + ev.seconds, source))
        elif isinstance(ev, RequestPreempted):
            self._stint(ev.request_id, ev.t).end = ev.t
            self.calls[ev.request_id].requeued.append(ev.t)
        elif isinstance(ev, RequestFinished):
            self._stint(ev.request.request_id, ev.t).end = ev.t
            self.calls[ev.request.request_id].finish = ev.t

    def _call(self, request_id: str, arrival: float | None = None) -> _Call:
        call = self.calls.get(request_id)
        if call is None:  # arrived before we subscribed: the engine knows when
            req = self.engine.requests[request_id]
            call = _Call(request_id, req.session_id,
                         req.arrival_s if arrival is None else arrival, len(self.calls))
            self.calls[request_id] = call
        return call

    def _stint(self, request_id: str, t: float) -> _Stint:
        """The call's current admission (one from `t` if we subscribed after it)."""
        call = self._call(request_id)
        if not call.stints:
            call.stints.append(_Stint(t))
        return call.stints[-1]

    def _step(self, ev: StepStarted) -> None:
        requests = self.engine.requests
        for ids in ev.requests:
            for rid in ids:
                stint = self._stint(rid, ev.t)
                # a fast-forwarded run (steps > 1) is decode steps only
                if ev.steps == 1 and not requests[rid].is_decoding:
                    stint.chunks.append((ev.t, ev.end))
                elif stint.decode_from is None:
                    stint.decode_from = ev.t

    # ------------------------------------------------------------------- table
    def frame(self, now: float | None = None) -> pd.DataFrame:
        """One row per interval (see the module docstring), calls in arrival order."""
        now = self.engine.now if now is None else now
        rows = []
        for call in self.calls.values():
            rows.extend(_rows(call, now))
        if not rows:
            return pd.DataFrame({c: pd.Series(dtype=object) for c in PHASE_COLUMNS})
        return pd.DataFrame(rows, columns=PHASE_COLUMNS)


def _rows(call: _Call, now: float) -> list[tuple]:
    """The intervals of one call as they stood at `now`, parents before children."""
    if call.arrival > now:
        return []
    done = call.finish is not None and call.finish <= now
    end = call.finish if done else now
    head = (call.request_id, call.session_id, call.rank, call.order)
    out = [(*head, "request", call.arrival, end, done, -1)]
    queued_from = [call.arrival] + [t for t in call.requeued if t <= now]
    stints = [st for st in call.stints if st.start <= now]
    for i, stint in enumerate(stints):
        out.append((*head, "queue", queued_from[i], stint.start, done, i))
        stop = stint.end if stint.end is not None and stint.end <= now else now
        chunks = [(a, min(b, stop)) for a, b in stint.chunks if a < stop]
        last = chunks[-1][1] if chunks else stint.start
        # decoding began where the last prefill chunk ended (at once when nothing was
        # left to prefill); a stint cut short while still prefilling is all prefill
        decoded = stint.decode_from is not None and stint.decode_from < stop
        prefill_end = last if decoded else stop
        out.append((*head, "prefill", stint.start, prefill_end, done, i))
        for start, until, source in call.waits:
            if stint.start <= start < stop:  # else another admission's
                out.append((*head, f"kv_{source}", start, min(until, prefill_end), done, i))
        out.extend((*head, "chunk", a, b, done, i) for a, b in chunks)
        if decoded:
            out.append((*head, "decode", prefill_end, stop, done, i))
    if len(queued_from) > len(stints):  # preempted, waiting to be admitted again
        out.append((*head, "queue", queued_from[-1], end, done, len(stints)))
    return out
