"""An instance: DP ranks that step together, and how one of their steps runs.

A plain DP rank is an instance of its own: it steps whenever it has work, at its own
pace. DP ranks that share MoE experts (DEP) cannot: every MoE layer exchanges tokens
among all of them, so they run each step in **lockstep** — a step lasts as long as its
slowest rank, the others *stall* for the difference, and a rank with nothing to do
runs a one-token dummy step so the collectives still line up.

A step is first *planned* (each rank's scheduler picks its batch and the data plane
predicts or measures how long it takes), then *committed* when its end time comes
(tokens emitted, requests finished). When every rank is in steady decode, the plan
may cover a whole run of steps (see `decode_run.py`).

The instance keeps the step counter that `prefill_schedule_interval` aligns on and
that drives speculative acceptance: step s accepts floor((s+1)·a) - floor(s·a) tokens
per decoding request, so acceptance length 2.99 gives exactly 299 tokens per 100
steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from labkit.engine.decode_run import DecodeRun, accepted_before, plan_decode_run
from labkit.engine.events import EventBus, StepsCompleted
from labkit.engine.sim.roofline import StepTiming
from labkit.engine.sim.work import StepWork

MAX_RUN_STEPS = 512
MIN_RUN_STEPS = 4  # planning a run costs about this many single steps


@dataclass(slots=True)
class Plan:
    start: float
    end: float
    steps: int
    finishes: bool  # some request ends when the plan is committed
    timing: StepTiming
    work: StepWork
    kv_used: np.ndarray  # (steps, ranks)
    batches: list | None = None  # a single step
    accepted: int = 0
    run: DecodeRun | None = None  # a fast-forwarded run


class Instance:
    def __init__(self, index: int, ranks: list[int], schedulers: list, data_plane,
                 config, events: EventBus) -> None:
        self.index = index
        self.ranks = ranks
        self.schedulers = schedulers
        self.data_plane = data_plane
        self.config = config
        self.events = events
        self.lockstep = len(schedulers) > 1
        self.acceptance = config.acceptance
        self.step_index = 0
        self.last_step_s = 0.0  # duration of the latest step, to size runs
        self.plan: Plan | None = None
        self.kv_total = np.array([s.kv.num_blocks for s in schedulers], dtype=np.int64)

    def has_work(self) -> bool:
        return any(s.has_work() for s in self.schedulers)

    @property
    def min_step_s(self) -> float:
        return self.data_plane.min_step_s

    # ------------------------------------------------------------------ plan
    def plan_next(self, now: float, horizon: float) -> Plan | None:
        """Plan the next step(s) starting at `now`; None if there is nothing to do."""
        if not self.has_work():
            return None
        for s in self.schedulers:
            s.now = now
            s.kv.set_time(now)
        plan = None
        if self._can_fast_forward() and horizon - now > MIN_RUN_STEPS * self.last_step_s:
            plan = self._plan_run(now, horizon)
        plan = plan or self._plan_step(now)
        self.last_step_s = float(plan.timing.duration[-1])
        return plan

    def _can_fast_forward(self) -> bool:
        if not (self.config.sim_fast_forward and self.data_plane.supports_runs):
            return False
        steady = [s.is_steady() for s in self.schedulers]
        return any(steady) and all(st or not s.has_work()
                                   for st, s in zip(steady, self.schedulers))

    def _plan_run(self, now: float, horizon: float) -> Plan | None:
        run = plan_decode_run(self.schedulers, self.step_index, self.acceptance, self.config,
                              self.data_plane.cost_model, self.lockstep, now, horizon,
                              MAX_RUN_STEPS)
        if run is None:
            return None
        return Plan(now, run.end, run.steps, run.finishes, run.timing, run.work,
                    run.kv_used, run=run)

    def _plan_step(self, now: float) -> Plan:
        batches = [s.schedule(self.step_index) for s in self.schedulers]
        work = StepWork.from_batches(batches)
        if work.idle.all() and self.step_index % self.config.prefill_schedule_interval == 0:
            raise RuntimeError(
                f"instance {self.index}: requests wait but none can be scheduled "
                f"(KV cache too small for the waiting requests?)"
            )
        timing = self.data_plane.execute(batches, work, self.lockstep)
        cum = accepted_before(self.step_index, 1, self.acceptance)
        accepted = int(cum[1])
        kv_used = np.array([[s.kv.pool.num_used for s in self.schedulers]], dtype=np.int64)
        end = now + float(timing.duration[0])
        finishes = any(_finishes(b, accepted) for b in batches)
        return Plan(now, end, 1, finishes, timing, work, kv_used, batches, accepted)

    # ---------------------------------------------------------------- commit
    def commit(self, plan: Plan) -> list:
        """Apply a plan at its end time; returns the requests it finished."""
        finished = []
        if plan.run is not None:
            finished = self._commit_run(plan.run)
        else:
            for s, batch in zip(self.schedulers, plan.batches):
                s.now = plan.end
                s.kv.set_time(plan.end)
                finished += s.update(batch, plan.accepted, plan.end)
        self._emit_steps(plan)
        self.step_index += plan.steps
        self.plan = None
        return finished

    def _commit_run(self, run: DecodeRun) -> list:
        ends = run.start + run.timing.duration
        gaps = np.diff(ends).tolist()
        total = int(run.cum[-1])
        pairs = [(s, req) for s, reqs in zip(self.schedulers, run.requests) for req in reqs]
        gained = [min(total, req.remaining_output_tokens) for _, req in pairs]
        self._cache_in_step_order(pairs, gained, run, ends)
        finished = []
        for (s, req), n in zip(pairs, gained):
            req.itl.append(float(ends[0]) - req.last_token_s)
            req.itl.extend(gaps)
            req.num_output_tokens += n
            req.num_computed_tokens += n
            req.last_token_s = float(ends[-1])
            if req.remaining_output_tokens <= 0:
                finished.append((s, req))
        end = float(ends[-1])
        for s, req in finished:
            s.kv.set_time(end)
            s.finish(req, end)
        return [req for _, req in finished]

    def _cache_in_step_order(self, pairs, gained, run: DecodeRun, ends: np.ndarray) -> None:
        """Register the blocks the run fills, in step order, stamped with their steps."""
        block_size = self.schedulers[0].kv.block_size
        before = np.array([req.num_computed_tokens for _, req in pairs], dtype=np.int64)
        after = before[:, None] + np.minimum(run.cum[None, 1:], np.array(gained)[:, None])
        blocks = np.concatenate([before[:, None], after], axis=1) // block_size
        req_idx, step_idx = np.nonzero(np.diff(blocks, axis=1))
        for j, i in sorted(zip(step_idx.tolist(), req_idx.tolist())):
            s, req = pairs[i]
            s.kv.set_time(float(ends[j]))
            req.num_computed_tokens = int(after[i, j])
            s.kv.cache_full_blocks(req)
            req.num_computed_tokens = int(before[i])

    def _emit_steps(self, plan: Plan) -> None:
        if not self.events.wants(StepsCompleted):
            return
        w, t = plan.work, plan.timing
        steps = np.arange(self.step_index, self.step_index + plan.steps)
        start = plan.run.start if plan.run is not None else np.array([plan.start])
        self.events.emit(StepsCompleted(
            t=plan.end, instance=self.index, ranks=self.ranks, step_index=steps, start=start,
            duration=t.duration, busy=t.busy, stall=t.stall,
            num_prefill_reqs=w.num_prefill_reqs, num_decode_reqs=w.num_decode_reqs,
            prefill_tokens=w.prefill_tokens, decode_tokens=w.decode_tokens,
            kv_used_blocks=plan.kv_used, kv_total_blocks=self.kv_total,
        ))


def _finishes(batch, accepted: int) -> bool:
    for req, n, ctx, decode in zip(batch.requests, batch.num_new_tokens, batch.contexts,
                                   batch.is_decode):
        remaining = req.remaining_output_tokens
        if decode and accepted >= remaining:
            return True
        if not decode and ctx + n == req.num_tokens and remaining <= 1:
            return True
    return False
