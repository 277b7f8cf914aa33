"""Replaying a trace: turning sessions into arrivals, closed or open loop.

**Closed loop** (how AgentX replays agentic traffic): `concurrency` sessions are in
flight at all times; when one ends the next begins. Inside a session a call is sent
`delay_s` (the tool's run time, capped at `max_idle_s`) after its parent completes —
and a main call that follows parallel subagents also waits for all of them, since
their results are part of its prompt. With `start_part_way`, the first sessions
begin at a random main call (seeded), as AgentX does to skip the phase in which every
session sits at its first turns. It is off by default: in a fresh engine such a
session's first call prefills its whole context cold (often several hundred thousand
tokens), which dominates the first minutes — use it with a `warmup_s` past those
prefills (the summary warns when cold prefills dominate, see `run_health.py`). When
the trace runs out of sessions it starts over with fresh block ids (a *salt*): the
same work, by new users.

A run covers `[0, duration_s]`, or less when the trace runs out first
(`loop_trace=False`, open loop): the summary's window then ends at the last event, so
throughput is not diluted by time in which nothing was left to do.

**Open loop**: every request with a timestamp arrives at that time, whatever the
engine's state (Mooncake traces); requests without one follow the session rule.

Calls that can never run are refused before the replay, or skipped with
``on_oversize="skip"`` (``oversize.py`` says what that does to their sessions). A
`SessionLedger` records when each session starts and ends, for task-level metrics.

Each call inherits the prefix hint its parent left on its rank, so looking up a long
context costs O(log n), and its trace ids (including the ids under which its
generated tokens will be cached, see `Trace.context_ids`) become its block keys.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
from tqdm.auto import tqdm

from labkit import checks
from labkit.engine.gc_pause import old_objects_frozen
from labkit.engine.interrupts import SafeInterrupt
from labkit.engine.kv.block_keys import ID_LIMIT, TraceBlockKeys, check_block_sizes
from labkit.engine.metrics import ReplayResult, collect_result
from labkit.engine.oversize import oversized_requests, plan_skips, skipped_row
from labkit.engine.request import Request
from labkit.engine.session_ledger import SessionLedger
from labkit.engine.slo import MetricOptions, metric_options
from labkit.errors import ConfigError

SESSIONS_PER_SLOT = 64  # closed loop: most sessions in flight per running slot


class TraceFeeder:
    """Feeds one trace into an engine and reacts to finished calls."""

    def __init__(self, engine, trace, open_loop: bool = False,
                 max_idle_s: float | None = None, seed: int = 0,
                 oversized: dict[str, str] | None = None) -> None:
        check_block_sizes(engine.block_size, trace.block_size)
        self.engine, self.trace = engine, trace
        self.open_loop = open_loop
        self.max_idle_s = math.inf if max_idle_s is None else max_idle_s
        self.rng = np.random.default_rng(seed)
        # ids the engine invents for blocks the trace does not name (a call's output
        # that no later call re-sends), numbered on from the trace's own: small keys,
        # which the prefix cache's index holds in its array (`key_index.py`), not its
        # dict -- an open-loop load's every decode block is one of them
        self._fresh = trace.max_hash_id + 1
        self._pending: dict[str, tuple] = {}  # engine id -> (trace request, epoch, session)
        self._waiting: dict[str, list] = {}  # engine id -> [unmet prerequisites, ready time]
        self._dependents: dict[str, list[str]] = {}  # engine id -> engine ids waiting on it
        self._session_of: dict[str, str] = {}  # engine id -> session key
        self._open_calls: dict[str, int] = {}  # session key -> calls not yet finished
        self._hints: dict[str, dict] = {}  # session key -> {finished engine id: hint}
        self._keys_of: dict[str, TraceBlockKeys] = {}  # engine id -> keys, while children wait
        self._children_left: dict[str, int] = {}  # engine id -> its calls not yet released
        self.oversized = oversized or {}  # trace request id -> why it can never run
        self.ledger = SessionLedger()
        self.skipped_rows: list[dict] = []
        self.calls_skipped = 0  # calls of part-way started sessions that never run
        self.calls_finished = 0
        self.on_session_end = None
        engine.finish_callbacks.append(self._on_finish)

    # ------------------------------------------------------------- sessions
    def start_session(self, session: list, epoch: int, at: float, skip_before: int = 0) -> bool:
        """Schedule one session's calls, leaving out those anchored before main call
        number `skip_before` (a part-way start) and the skipped ones; False when no
        call is left (the session is over at once)."""
        key = f"{session[0].session_id}@{epoch}"
        session_id = session[0].session_id if epoch == 0 else key
        anchor = _anchors(session)
        live = [tr for tr in session if anchor[tr.request_id] >= skip_before]
        skips = plan_skips(live, self.oversized, self.open_loop)
        for tr in live:
            if tr.request_id in skips:
                self.skipped_rows.append(skipped_row(
                    _engine_id(tr.request_id, epoch), session_id,
                    _engine_id(tr.parent_id, epoch), tr, skips[tr.request_id]))
        live = [tr for tr in live if tr.request_id not in skips]
        live_ids = {tr.request_id for tr in live}
        for tr in live:
            if tr.parent_id in live_ids:
                parent = _engine_id(tr.parent_id, epoch)
                self._children_left[parent] = self._children_left.get(parent, 0) + 1
        self.calls_skipped += len(session) - len(live)
        self._open_calls[key] = len(live)
        self._hints[key] = {}
        self.ledger.opened(key, session_id, len(live), skip_before > 0, len(skips))
        releases = []
        for tr in live:
            eid = _engine_id(tr.request_id, epoch)
            self._pending[eid] = (tr, epoch, key)
            self._session_of[eid] = key
            if self.open_loop and tr.timestamp is not None:
                releases.append((eid, tr.timestamp))
                continue
            prereqs = []
            if tr.parent_id in live_ids:
                prereqs = [tr.parent_id] + [j.request_id for j in self.trace.joins(tr)
                                            if j.request_id in live_ids]
            if not prereqs:
                releases.append((eid, at + (tr.delay_s if tr.parent_id is None else 0.0)))
                continue
            self._waiting[eid] = [len(prereqs), at]
            for p in prereqs:
                self._dependents.setdefault(_engine_id(p, epoch), []).append(eid)
        for eid, t in releases:
            self._release(eid, t)
        if not live:  # nothing to wait for: over now (the caller starts the next one)
            del self._open_calls[key], self._hints[key]
            self.ledger.closed(key, at)
        return bool(live)

    # ------------------------------------------------------------ requests
    def _release(self, eid: str, at: float) -> None:
        tr, epoch, key = self._pending.pop(eid)
        self._waiting.pop(eid, None)
        self.ledger.released(key, at)
        parent = _engine_id(tr.parent_id, epoch)
        req = Request(
            request_id=eid, session_id=tr.session_id if epoch == 0 else key,
            num_prompt_tokens=tr.input_length, max_output_tokens=tr.output_length,
            arrival_s=at, kind=tr.kind, parent_id=parent, priority=tr.priority, trace=tr,
        )
        if self.engine.computes:
            self._real_tokens(req, tr, epoch, parent)
        else:
            req.keys = self._keys(tr, epoch, parent)
            if self._children_left.get(eid, 0) > 0:
                self._keys_of[eid] = req.keys
            req.forked_tokens = min(self.trace.fork_tokens(tr), tr.input_length - 1)
        if parent is not None:
            req.prefix_hint = self._inherit(key, parent)
        self.engine.submit(req, at=max(at, self.engine.now))

    def _inherit(self, key: str, parent: str):
        """The hint `parent` left (None if none), for one of its calls. A hint is read
        by nothing else, so the last of them takes it out: a session keeps only the
        hints some call of it will still inherit (each holds its whole prefix's blocks:
        kept for every finished call, they grew by ~0.1 MB per simulated second on
        `labkit bench sim`'s fast workload). The parent's keys, kept to lend, go with it."""
        left = self._children_left.pop(parent, 0) - 1
        if left > 0:
            self._children_left[parent] = left
            return self._hints[key].get(parent)
        self._keys_of.pop(parent, None)
        return self._hints[key].pop(parent, None)

    def _real_tokens(self, req: Request, tr, epoch: int, parent: str | None) -> None:
        """Compute plane: the prompt's token ids. A call that continues another re-sends
        its parent's actual context (prompt and *generated* tokens) as far as the trace
        says it does, then its own new content expanded from its block ids."""
        from labkit.engine.compute.tokens import prompt_tokens
        from labkit.engine.kv.block_keys import TokenBlockKeys

        engine, trace = self.engine, self.trace
        ids = tr.hash_ids + epoch * ID_LIMIT if epoch else tr.hash_ids
        tokens = prompt_tokens(ids, tr.input_length, trace.block_size, engine.model.vocab_size)
        shared = 0
        parent_req = engine.requests.get(parent) if parent else None
        if parent_req is not None:
            shared = min(trace.context_shared_tokens(tr), len(parent_req.token_ids),
                         tr.input_length - 1)
            tokens[:shared] = parent_req.token_ids[:shared]
        req.prompt_token_ids = tokens
        req.keys = TokenBlockKeys(tokens, engine.block_size, extra=("epoch", epoch))
        req.forked_tokens = shared if tr.kind == "subagent" and parent_req is not None \
            and parent_req.kind == "main" else 0

    def _keys(self, tr, epoch: int, parent: str | None) -> TraceBlockKeys:
        ids = self.trace.context_ids(tr)
        unknown = ids < 0
        if unknown.any():
            ids = ids.copy()
            count = int(unknown.sum())
            ids[unknown] = np.arange(self._fresh, self._fresh + count, dtype=np.int64)
            self._fresh += count
        keys = TraceBlockKeys(ids, self.trace.block_size, self.engine.block_size,
                              salt=epoch * ID_LIMIT)
        parent_keys = self._keys_of.get(parent)
        if parent_keys is not None:
            keys.lend(parent_keys, self.trace.context_shared_tokens(tr))
        return keys

    def _on_finish(self, req: Request, t: float) -> None:
        key = self._session_of.pop(req.request_id, None)
        if key is None:
            return  # not one of ours
        self.calls_finished += 1
        if self._children_left.get(req.request_id, 0) > 0:  # (else none will read it)
            self._hints[key][req.request_id] = req.prefix_hint
        req.prefix_hint = None
        for dep in self._dependents.pop(req.request_id, []):
            state = self._waiting[dep]
            state[0] -= 1
            state[1] = max(state[1], t)
            if state[0] == 0:
                tr = self._pending[dep][0]
                self._release(dep, state[1] + min(tr.delay_s, self.max_idle_s))
        self._open_calls[key] -= 1
        if self._open_calls[key] == 0:
            self._session_done(key, t)

    def _session_done(self, key: str, t: float) -> None:
        del self._open_calls[key]
        del self._hints[key]
        self.ledger.closed(key, t)
        if self.on_session_end is not None:
            self.on_session_end(t)


def _anchors(session: list) -> dict[str, int]:
    """Index of the main call each call belongs to (subagents: their fork point)."""
    anchor, mains = {}, 0
    for tr in session:
        if tr.kind == "main":
            anchor[tr.request_id] = mains
            mains += 1
        else:
            anchor[tr.request_id] = anchor.get(tr.parent_id, 0)
    return anchor


def _engine_id(request_id: str | None, epoch: int) -> str | None:
    if request_id is None:
        return None
    return request_id if epoch == 0 else f"{request_id}@{epoch}"


class ClosedLoop:
    """Keeps `concurrency` sessions in flight, cycling through the trace."""

    def __init__(self, feeder: TraceFeeder, concurrency: int, start_part_way: bool,
                 loop_trace: bool = True) -> None:
        self.feeder = feeder
        self.sessions = feeder.trace.sessions()
        if not self.sessions:
            raise ConfigError("the trace has no sessions to replay")
        self.loop_trace = loop_trace
        self.next = 0
        feeder.on_session_end = self._start_next
        for i in range(min(concurrency, len(self.sessions)) if not loop_trace else concurrency):
            skip = 0
            if start_part_way:
                mains = sum(tr.kind == "main" for tr in self.sessions[i % len(self.sessions)])
                skip = int(feeder.rng.integers(0, max(mains, 1)))
            self._start_next(0.0, skip)

    def _start_next(self, t: float, skip: int = 0) -> None:
        while True:  # past sessions whose every call is skipped
            epoch, index = divmod(self.next, len(self.sessions))
            if epoch and not self.loop_trace:
                return  # every session has been replayed once
            self.next += 1
            if self.feeder.start_session(self.sessions[index], epoch, t, skip):
                return
            skip = 0


@dataclass(slots=True)
class ReplayRun:
    """A replay set up on an engine: drive it with `engine.step()` (or `finish`), and
    collect its tables at any moment with `result()`."""

    engine: object
    trace: object
    duration_s: float | None
    warmup_s: float
    extra: dict
    wall_start: float
    feeder: TraceFeeder
    options: MetricOptions
    skip_mode: bool = False

    @property
    def total_calls(self) -> int:
        """Calls this replay will send when it runs to the end of its trace."""
        return len(self.trace.requests) - self.feeder.calls_skipped

    @property
    def end_s(self) -> float:
        """Where the run's window ends: `duration_s` if the run was stopped there with
        work left; else now (still running, or the trace ran out earlier)."""
        engine = self.engine
        stopped = not engine.has_events() and engine.has_events(before=math.inf)
        if self.duration_s is not None and (stopped or engine.now >= self.duration_s):
            return self.duration_s
        return engine.now

    def finish(self, progress: bool = False) -> ReplayResult:
        """Run the replay to its end (`duration_s`; also after `engine.run_until` has
        stopped it earlier) and collect its tables."""
        self.engine.stop_s = math.inf if self.duration_s is None else self.duration_s
        # (full collections skip what exists, `gc_pause.py`; Ctrl-C between events,
        # `interrupts.py`)
        with old_objects_frozen(), SafeInterrupt() as stop:
            if not progress:
                while self.engine.step():
                    stop.check()
            elif self.duration_s is not None:
                _run_timed(self, self.duration_s, stop)
            else:
                _run_counted(self, stop)
            return self.result()

    def result(self) -> ReplayResult:
        return collect_result(self.engine, warmup_s=self.warmup_s, end_s=self.end_s,
                              wall_s=time.perf_counter() - self.wall_start, extra=self.extra,
                              sessions=self.feeder.ledger.frame(), options=self.options,
                              skipped=self.feeder.skipped_rows if self.skip_mode else None)


def start_replay(engine, trace, concurrency: int | None = None,
                 duration_s: float | None = None, open_loop: bool = False,
                 warmup_s: float = 0.0, max_idle_s: float | None = None,
                 start_part_way: bool = False, loop_trace: bool = True,
                 on_oversize: str = "error", slo: str | dict | None = None,
                 percentiles=None, gpu_hour_usd: float | None = None) -> ReplayRun:
    """Check the inputs and schedule the trace's arrivals; nothing runs yet."""
    check_replay_args(engine, concurrency, duration_s, open_loop, warmup_s, max_idle_s)
    if concurrency is not None and duration_s is None and loop_trace:
        raise ConfigError("a closed-loop replay needs duration_s (or loop_trace=False)")
    if open_loop and any(tr.timestamp is None and tr.parent_id is None for tr in trace.requests):
        raise ConfigError("open-loop replay needs a timestamp on every first call "
                          "(use a closed loop with concurrency for session traces)")
    options = metric_options(slo, percentiles, gpu_hour_usd)
    oversized = oversized_requests(engine, trace, on_oversize)

    wall = time.perf_counter()
    feeder = TraceFeeder(engine, trace, open_loop, max_idle_s, seed=engine.config.seed,
                         oversized=oversized)
    if open_loop:
        for session in trace.sessions():
            feeder.start_session(session, 0, 0.0)
    else:
        ClosedLoop(feeder, concurrency, start_part_way, loop_trace)
    engine.stop_s = math.inf if duration_s is None else duration_s
    extra = {"concurrency": concurrency, "open_loop": open_loop,
             "start_part_way": bool(start_part_way and not open_loop)}
    return ReplayRun(engine, trace, duration_s, warmup_s, extra, wall, feeder, options,
                     skip_mode=on_oversize == "skip")


def check_replay_args(engine, concurrency, duration_s, open_loop, warmup_s, max_idle_s,
                      spell=str) -> None:
    """Refuse replay arguments that would run forever or report nonsense, naming each as
    `spell(name)` (the CLI spells them as its flags). A closed loop keeps at most
    `SESSIONS_PER_SLOT` sessions per running slot (max_num_seqs on every DP rank) in
    flight: beyond that they only wait in the queue, and cost memory all the same."""
    if not isinstance(open_loop, bool):
        raise ConfigError(f"{spell('open_loop')}={open_loop!r} must be True or False")
    if open_loop == (concurrency is not None):
        raise ConfigError("give either concurrency (closed loop) or open_loop=True")
    checks.integer(spell("concurrency"), concurrency, low=1,
                   high=SESSIONS_PER_SLOT * engine.running_slots, none=True)
    checks.number(spell("duration_s"), duration_s, low=0, low_open=True, none=True)
    checks.number(spell("warmup_s"), warmup_s, low=0)
    if duration_s is not None and warmup_s >= duration_s:
        raise ConfigError(f"{spell('warmup_s')}={warmup_s} leaves nothing to measure: it must "
                          f"be below {spell('duration_s')}={duration_s}")
    checks.number(spell("max_idle_s"), max_idle_s, low=0, none=True)


def replay(engine, trace, concurrency: int | None = None, duration_s: float | None = None,
           progress: bool = False, **options) -> ReplayResult:
    """See `Engine.replay`. Closed loop: `concurrency` sessions for `duration_s`;
    with loop_trace=False each session runs once and duration_s may be omitted.
    `options` are those of `start_replay`."""
    run = start_replay(engine, trace, concurrency, duration_s, **options)
    return run.finish(progress)


def _run_timed(run: ReplayRun, duration_s: float, stop: SafeInterrupt) -> None:
    """A bar over simulated seconds, whole ones, up to `duration_s`; a run that ends
    sooner (its trace ran out) closes the bar where it ended."""
    engine = run.engine
    with tqdm(total=math.ceil(duration_s), unit="sim s", desc="replay") as bar:
        while engine.step():
            stop.check()
            done = int(min(engine.now, duration_s))
            if done > bar.n:
                bar.update(done - bar.n)
        if run.end_s < duration_s:  # nothing left to do before the end
            bar.total = max(int(math.ceil(run.end_s)), bar.n)
        bar.update(bar.total - bar.n)


def _run_counted(run: ReplayRun, stop: SafeInterrupt) -> None:
    """A bar over the calls of the trace (no duration: the run goes until all finish)."""
    engine, feeder = run.engine, run.feeder
    with tqdm(total=run.total_calls, unit="call", desc="replay") as bar:
        while engine.step():
            stop.check()
            if feeder.calls_finished > bar.n:
                bar.update(feeder.calls_finished - bar.n)
        bar.update(feeder.calls_finished - bar.n)
