"""An instance: DP ranks that step together, and how one of their steps runs.

A plain DP rank is an instance of its own: it steps whenever it has work, at its own
pace. DP ranks that share MoE experts (DEP) cannot: every MoE layer exchanges tokens
among all of them, so they run each step in **lockstep** — a step lasts as long as its
slowest rank, the others *stall* for the difference, and a rank with nothing to do
runs a one-token dummy step so the collectives still line up.

A step is first *planned* (each rank's scheduler picks its batch, the batches and the
commands queued since the last step go to the data plane as one `StepInput`, and the
`StepOutput` says how long the step takes), then *committed* when its end time comes
(tokens emitted, requests finished). When every rank is in steady decode, the plan
may cover a whole run of steps (see `decode_run.py`).

The instance keeps the step counter that `prefill_schedule_interval` aligns on and
that drives speculative acceptance: step s accepts floor((s+1)·a) - floor(s·a) tokens
per decoding request, so acceptance length 2.99 gives exactly 299 tokens per 100
steps.

Async scheduling (vLLM's default): the scheduler decides step N+1 while step N runs,
so a request that arrives during step N first runs in step N+2. The instance models it
by hiding, from a step planned the moment the previous one ended, the requests that
arrived after that previous step began — unless nothing is running (vLLM's engine,
idle, schedules a newcomer at once).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from labkit.engine.decode_run import DecodeRun
from labkit.engine.run_plan import accepted_before, plan_decode_run
from labkit.engine.events import EventBus, RequestTokens, StepsCompleted, StepStarted
from labkit.engine.kv.batch_play import plays_in_batches
from labkit.engine.step_work import StepTiming, StepWork
from labkit.engine.step_message import Outbox, step_input

# a run plans at most this many steps (an arrival usually cuts it sooner; on the fast
# workload of `labkit bench sim` 1024 runs ~4 % faster than 512 or 1536)
MAX_RUN_STEPS = 1024
# ... and, where arrivals have been cutting runs, about twice as many as the last run
# cut ran, but not fewer than this: planning costs in proportion to the steps planned
# (an open-loop load cutting every few steps would otherwise plan a thousand each time),
# and how many steps a run plans never changes what happens, only when the next is planned
MIN_PLANNED_STEPS = 32
PLANNED_CELLS = 4096  # (requests x steps: planning fewer costs about as much as one step)
MIN_RUN_STEPS = 4  # planning a run costs about this many single steps


@dataclass(slots=True)
class Plan:
    start: float
    end: float
    finishes: bool  # some request ends when the plan is committed
    timing: StepTiming
    work: StepWork
    kv_used: np.ndarray  # (steps, ranks)
    batches: list | None = None  # a single step
    accepted: int = 0
    run: DecodeRun | None = None  # a fast-forwarded run
    tokens: dict | None = None  # computed: request id -> the token ids it produced

    @property
    def steps(self) -> int:
        return self.run.steps if self.run is not None else 1


class Instance:
    def __init__(self, index: int, ranks: list[int], schedulers: list, data_plane,
                 config, events: EventBus, outbox: Outbox | None = None,
                 kv_bytes_per_block: float = 0.0) -> None:
        """`outbox`: the engine's commands for the data plane (they ride on the next
        step); `kv_bytes_per_block`: one block's bytes per GPU (for the step events)."""
        self.index = index
        self.ranks = ranks
        self.schedulers = schedulers
        self.data_plane = data_plane
        self.outbox = outbox
        self.config = config
        self.events = events
        self.lockstep = len(schedulers) > 1
        self.acceptance = config.acceptance
        self.step_index = 0
        self.last_step_s = 0.0  # duration of the latest step, to size runs
        self.plan: Plan | None = None
        self.plan_version = 0  # bumped when a plan is made or cut short
        self.kv_total = np.array([s.kv.num_blocks for s in schedulers], dtype=np.int64)
        self.kv_bytes_per_block = kv_bytes_per_block
        self.last_step = (-1.0, -1.0)  # (start, end) of the latest committed step
        self.rest = None  # what the run an arrival cut had planned past the cut (RunRest)
        self.run_steps = MAX_RUN_STEPS  # how many steps the next run plans at most

    def has_work(self) -> bool:
        return any(s.has_work() for s in self.schedulers)

    def holds_kv_for_others(self) -> bool:
        """Do finished calls hold KV here until someone takes it (a P/D prefill group's
        hand-overs)? Then waiting requests short of room will get it."""
        return any(s.hold_kv_on_finish and len(s.kv.tables) > len(s.running)
                   for s in self.schedulers)

    @property
    def min_step_s(self) -> float:
        return self.data_plane.min_step_s

    # ------------------------------------------------------------------ plan
    def plan_next(self, now: float, horizon: float) -> Plan | None:
        """Plan the next step(s) starting at `now`; None if there is nothing to do."""
        if not self.has_work():
            self.rest = None
            return None
        visible = self._visible_until(now)
        for s in self.schedulers:
            s.now = now
            s.visible_until = visible
            s.kv.set_time(now)
        plan = None
        if self._can_fast_forward():
            if horizon - now > MIN_RUN_STEPS * self.last_step_s:
                plan = self._plan_run(now, horizon)
            plan = plan or self._plan_step(now)
        else:  # the step may find the schedulers steady once it has scheduled
            plan = self._plan_step(now, horizon)
        self.rest = None  # (it serves the plan right after the cut only)
        if plan is not None:
            self.last_step_s = float(plan.timing.duration[-1])
            if self.events.wants(StepStarted):
                self._emit_started(plan)
        return plan

    def _visible_until(self, now: float) -> float:
        """Arrivals a step planned at `now` sees (see the module docstring)."""
        start, end = self.last_step
        if not self.config.async_scheduling or end != now or \
                not any(s.running for s in self.schedulers):
            return now
        return start

    def _emit_started(self, plan: Plan) -> None:
        if plan.run is not None:
            per_rank = [[r.request_id for s2, r in plan.run.pairs if s2 is s]
                        for s in self.schedulers]
        else:
            per_rank = [[r.request_id for r in b.requests] for b in plan.batches]
        self.events.emit(StepStarted(plan.start, self.index, self.ranks, self.step_index,
                                     plan.steps, plan.end, per_rank))

    def _can_fast_forward(self) -> bool:
        if not (self.config.sim_fast_forward and self.data_plane.supports_runs):
            return False
        steady = [s.is_steady() for s in self.schedulers]
        return any(steady) and all(st or not s.has_work()
                                   for st, s in zip(steady, self.schedulers))

    def _plan_run(self, now: float, horizon: float, batches=None) -> Plan | None:
        """A fast-forwarded run from now; `batches`: its first step, scheduled already
        (the run is taken only if its step 0 is exactly that step). It may take over
        the steps a run cut just before had planned (`self.rest`)."""
        scheduled = batches is not None
        run = plan_decode_run(self.schedulers, self.step_index, self.acceptance, self.config,
                              self.data_plane.cost_model, self.lockstep, now, horizon,
                              self._steps_to_plan(),
                              self.last_step_s, scheduled, self.rest,
                              min_run_steps=MIN_RUN_STEPS, leave=self._may_leave())
        if run is None or (scheduled and not run.starts_as(batches)):
            return None
        return Plan(now, run.commit_end, run.finishes, run.timing, run.work, run.kv_used,
                    run=run)

    def _steps_to_plan(self) -> int:
        """How many steps the next run plans at most: as many as runs have lately run
        before an arrival cut them (`run_steps`), unless planning that many more would
        cost little (few requests), and at least those a cut run left to reuse."""
        running = sum(len(s.running) for s in self.schedulers)
        cheap = PLANNED_CELLS // max(running, 1)
        rest = len(self.rest.start) if self.rest is not None else 0
        return min(max(self.run_steps, cheap, rest), MAX_RUN_STEPS)

    def _may_leave(self) -> bool:
        """May a request that finishes leave a run, the others decoding on? On one rank
        only: ranks in lockstep, each with its own count of requests leaving, would
        price a new shape of step at each leaving, most of them for nothing (an arrival
        cuts the run first), and a rank left with only KV on the wire would wait for
        it, not step (one rank's run ends with its last request). Nor while someone
        reads StepStarted (it names a run's requests: a step-by-step replay announces
        the steps after the finish apart) or RequestTokens (which lists the finished
        request's KV freed in the step it finished)."""
        return not (self.lockstep or self.events.wants(StepStarted)
                    or self.events.wants(RequestTokens))

    def _run_from_step(self, batches, now: float, horizon: float) -> Plan | None:
        """The step just scheduled as the first of a fast-forwarded run, or None.

        A step that admits a request (its prefix KV put on the wire, or its first prompt
        chunk) usually leaves the ranks steady: the run that would be planned when it
        ends may as well start with it. The scheduler has done step 0's KV work (its
        blocks allocated, its chunks registered), so the run starts past it; it is
        taken only if its step 0 is exactly the batches scheduled, nothing preempted,
        no command waits to ride on the step."""
        if any(b.preempted for b in batches) or (self.outbox is not None
                                                  and self.outbox.commands) \
                or not self._can_fast_forward() \
                or horizon - now <= MIN_RUN_STEPS * self.last_step_s:
            return None
        return self._plan_run(now, horizon, batches)

    def next_ready_s(self) -> float | None:
        """The earliest time a request now waiting for fetched KV can run."""
        times = [t for s in self.schedulers if (t := s.next_ready_s()) is not None]
        return min(times) if times else None

    def _plan_step(self, now: float, horizon: float | None = None) -> Plan | None:
        """One step, scheduled now; with a `horizon`, the first step of a run where the
        schedulers are steady once it is scheduled (`_run_from_step`)."""
        # the shared step index: prefill_schedule_interval's beat, the same on every rank
        batches = [s.schedule(self.step_index) for s in self.schedulers]
        work = StepWork.from_batches(batches)
        if work.idle.all():
            return None  # nothing can run yet (KV still being fetched); see next_ready_s
        if horizon is not None:
            plan = self._run_from_step(batches, now, horizon)
            if plan is not None:
                return plan
        out = self.data_plane.execute(step_input(batches, self.schedulers, work, self.lockstep,
                                                 self.outbox, self.data_plane.computes))
        if out.reports:  # about the commands it carried (the offload reads them)
            self.outbox.receive(out.reports)
        timing = out.timing
        cum = accepted_before(self.step_index, 1, self.acceptance)
        accepted = int(cum[1])
        kv_used = np.array([[s.kv.pool.num_used for s in self.schedulers]], dtype=np.int64)
        end = now + float(timing.duration[0])
        finishes = any(_finishes(b, accepted, out.tokens) for b in batches)
        return Plan(now, end, finishes, timing, work, kv_used, batches, accepted,
                    tokens=out.tokens)

    # ---------------------------------------------------------------- commit
    def commit(self, plan: Plan) -> list:
        """Apply a plan at its end time; returns the requests it finished. A run whose
        requests leave it as they finish is committed up to each finish, then goes on
        (`plan.end` moves to its next commit)."""
        run = plan.run
        stop = run.next_stop if run is not None else 1
        self.last_step = (float(run.start[stop - 1]) if run is not None else plan.start,
                          plan.end)
        if run is not None and stop < run.steps:
            return self._commit_to_finish(plan, stop)
        if run is not None:
            first, steps = run.committed, run.steps
            if steps >= self.run_steps:  # it ran all it could plan: plan more next time
                self.run_steps = min(2 * self.run_steps, MAX_RUN_STEPS)
            pairs = run.play(steps, steps)
            if self.events.wants(RequestTokens):
                # the steps before the last one end before anyone finishes (as stepping
                # one by one would announce them): their requests still hold their KV
                last = steps - 1 if pairs else steps
                self._emit_steps(plan, first, last)
                finished = self._finish(pairs, plan.end)
                self._emit_steps(plan, max(first, last), steps)
            else:  # (the steps' own columns do not change as requests finish)
                finished = self._finish(pairs, plan.end)
                self._emit_steps(plan, first, steps)
        else:
            finished = []
            for s, batch in zip(self.schedulers, plan.batches):
                s.now = plan.end
                s.kv.set_time(plan.end)
                finished += s.update(batch, plan.accepted, plan.end, plan.tokens)
            self._emit_steps(plan, 0, 1)
        self.plan = None
        return finished

    def _commit_to_finish(self, plan: Plan, stop: int) -> list:
        """Commit a run up to its next finish (`stop` steps); the others go on. The
        blocks the finished requests free come off the run's later steps' KV use."""
        run, first = plan.run, plan.run.committed
        pairs = run.play(stop, stop)
        used = [s.kv.pool.num_used for s in self.schedulers]
        finished = self._finish(pairs, plan.end)
        self._emit_steps(plan, first, stop)
        run.kv_used[stop:] -= np.array(used) - [s.kv.pool.num_used for s in self.schedulers]
        run.drop_finished()
        plan.end = run.commit_end
        return finished

    @staticmethod
    def _finish(pairs, t: float) -> list:
        """The (scheduler, request) pairs a run finished, finished at t."""
        for s, req in pairs:
            s.kv.set_time(t)
            s.finish(req, t)
        return [req for _, req in pairs]

    def sync(self, t: float, cut: bool = True) -> bool:
        """Someone looks at this instance at time t. If a fast-forwarded run is under
        way: with `cut` (an arrival joins this instance), cut it after the step in
        progress, so the newcomer may join the next step; without (a router or another
        rank reads it), play it up to t — the steps begun before t have allocated,
        those ended before t have emitted. Returns True if the plan's end moved.

        A cut plays nothing: until the cut run ends nobody reads this instance's KV or
        requests but through a sync or `lookup_at`, which play first, and the newcomer
        is scheduled after it; the commit then plays the run in one go, the same work
        in the same order as playing up to t now and the rest later."""
        plan = self.plan
        if plan is None or plan.run is None or t >= (plan.run.end if cut else plan.end):
            return False
        run = plan.run
        started = max(1, int(run.start.searchsorted(t, side="left")))
        if cut:
            keep = started + self._hides(run, started, t)
            if keep >= run.steps:
                return False
            self.run_steps = min(max(2 * keep, MIN_PLANNED_STEPS), MAX_RUN_STEPS)
            self.rest = run.rest(keep, self.step_index + keep - run.committed)
            run.truncate(keep)
            plan.timing, plan.work, plan.kv_used = run.timing, run.work, run.kv_used
            end, plan.end, plan.finishes = plan.end, run.commit_end, run.finishes
            return plan.end != end
        ended = int(run.ends.searchsorted(t, side="left"))
        first = run.committed
        if run.play(started, ended):
            raise RuntimeError("a request finished inside a fast-forwarded run")
        self._emit_steps(plan, first, ended)
        return False

    def lookup_at(self, scheduler, req, now: float):
        """req's prefix as `scheduler`'s rank caches it at `now` for another rank to fetch
        (`KVManager.lookup` of computed blocks). A run under way is played up to now first
        (`sync`), unless that cannot change the answer (`DecodeRun.could_change_lookup`):
        then it plays later, in one piece with the rest of it."""
        kv, plan = scheduler.kv, self.plan
        if plan is None or plan.run is None or now >= plan.end:
            return kv.lookup(req, computed_only=True)  # nothing to play
        if plays_in_batches(kv) and not req.forked_tokens and req.keys is not None:
            match = kv.lookup(req, computed_only=True)
            if not plan.run.could_change_lookup(scheduler, req, match, now):
                return match
        self.sync(now, cut=False)
        return kv.lookup(req, computed_only=True)

    def _hides(self, run: DecodeRun, started: int, arrival_s: float) -> int:
        """1 if the run's step after the one in progress is planned before a request that
        arrived at `arrival_s` is visible (async scheduling: it sees arrivals up to the
        start of the step before it), so it is the same decode step and the run keeps
        it; else 0.
        (Off the prefill beat a step also notes that requests wait: not for runs then.)"""
        return int(self.config.async_scheduling and self.config.prefill_schedule_interval == 1
                   and run.start[started - 1] < arrival_s)

    def _emit_steps(self, plan: Plan, first: int, stop: int) -> None:
        """StepsCompleted for steps [first, stop) of the plan; advances the counter."""
        if stop <= first:
            return
        start = plan.run.start if plan.run is not None else np.array([plan.start])
        end = float(start[stop - 1] + plan.timing.duration[stop - 1])
        if self.events.wants(RequestTokens):
            self._emit_tokens(plan, first, stop, end)
        if self.events.wants(StepsCompleted):
            w, t = plan.work, plan.timing
            cut = slice(first, stop)
            self.events.emit(StepsCompleted(
                t=end, instance=self.index,
                ranks=self.ranks, step_index=np.arange(self.step_index,
                                                       self.step_index + stop - first),
                start=start[cut], duration=t.duration[cut], busy=t.busy[cut],
                stall=t.duration[cut, None] - t.busy[cut], compute=t.compute[cut],
                comm=t.comm[cut],
                num_prefill_reqs=w.num_prefill_reqs[cut],
                num_decode_reqs=w.num_decode_reqs[cut], prefill_tokens=w.prefill_tokens[cut],
                decode_tokens=w.decode_tokens[cut], kv_used_blocks=plan.kv_used[cut],
                kv_total_blocks=self.kv_total,
                persistent_kv_bytes=plan.kv_used[cut] * self.kv_bytes_per_block,
                temporary_kv_bytes=t.temporary_kv_bytes[cut],
            ))
        self.step_index += stop - first

    def _run_tokens(self, run: DecodeRun, first: int, stop: int):
        """RequestTokens columns of steps [first, stop) of a run, ordered as a single
        step orders them: per rank, the stepping requests, then those whose KV is still
        on the wire (no new tokens). (A deferred prefill chunk, listed with the latter
        by a single step, is the rank's last request either way: `chunk_run.py`.)"""
        context, held = run.tokens(first, stop)
        steps = stop - first
        new = run.new[:, first:stop].T
        decode = new > 0
        if run.prefill is not None:
            decode &= ~run.prefill[:, first:stop].T
        columns, pairs = [], []
        for s in self.schedulers:
            mine = [i for i, (owner, _) in enumerate(run.pairs) if owner is s]
            wire = [r for r in s.running if s.on_the_wire(r)]
            pairs += [run.pairs[i] for i in mine] + [(s, r) for r in wire]
            waiting = np.array([[r.num_computed_tokens for r in wire]] * steps,
                               dtype=np.int64).reshape(steps, len(wire))
            columns.append((context[:, mine], held[:, mine], new[:, mine], decode[:, mine],
                            waiting))
        joined = [np.concatenate([np.concatenate([c[f], c[4] if f < 2 else
                                                  np.zeros_like(c[4], dtype=c[f].dtype)],
                                                 axis=1) for c in columns], axis=1)
                  for f in range(4)]
        context, held, num_new, decode = joined
        return pairs, context, num_new, decode, held

    def _emit_tokens(self, plan: Plan, first: int, stop: int, end: float) -> None:
        """RequestTokens for steps [first, stop) of the plan (before the counter moves)."""
        if plan.run is not None:
            pairs, context, num_new, decode, held = self._run_tokens(plan.run, first, stop)
        else:
            rows = []  # (scheduler, request, context, new tokens, decode)
            for s, batch in zip(self.schedulers, plan.batches):
                rows += [(s, *entry) for entry in zip(batch.requests, batch.contexts,
                                                       batch.num_new_tokens, batch.is_decode)]
                stepped = set(map(id, batch.requests))
                rows += [(s, r, r.num_computed_tokens, 0, False) for r in s.running
                         if id(r) not in stepped]  # waiting for KV on the wire
            pairs = [(s, r) for s, r, *_ in rows]
            context = np.array([[row[2] for row in rows]], dtype=np.int64)
            num_new = np.array([[row[3] for row in rows]], dtype=np.int64)
            decode = np.array([[row[4] for row in rows]], dtype=bool)
            held = np.array([[r.num_computed_tokens for _, r in pairs]], dtype=np.int64)
        still = np.array([r.request_id in s.kv.tables for s, r in pairs], dtype=bool)
        self.events.emit(RequestTokens(
            t=end, instance=self.index,
            step_index=np.arange(self.step_index, self.step_index + stop - first),
            request_ids=[r.request_id for _, r in pairs],
            ranks=np.array([s.rank for s, _ in pairs], dtype=np.int64),
            context=context, num_new=num_new, decode=decode, held=held * still))


def _finishes(batch, accepted: int, tokens: dict | None = None) -> bool:
    for req, n, ctx, decode in zip(batch.requests, batch.num_new_tokens, batch.contexts,
                                   batch.is_decode):
        remaining = req.max_output_tokens - req.num_output_tokens
        gained = accepted if accepted < n else n  # a decode cut by the budget verifies
        if tokens is not None and req.request_id in tokens:  # fewer drafts
            gained = len(tokens[req.request_id])
        if decode and gained >= remaining:
            return True
        if not decode and ctx + n == req.num_tokens and remaining <= 1:
            return True
    return False
