"""Planning a fast-forwarded run: its steps, their tokens, costs and blocks.

`plan_decode_run` looks at the instance's schedulers when a run may start (every rank
steady: `Instance._can_fast_forward`, or the step just scheduled leaves them so) and
plans up to `MAX_RUN_STEPS` steps at once, as (request, step) and (step, rank) arrays:

1. the tokens — each request holds ``cum[j]`` more after j steps (the deterministic
   acceptance counter, `accepted_before`), a prompt continued chunk by chunk takes
   what the budget leaves (`chunk_run.plan_tokens`); a request that finishes leaves
   the run (`decode_run.py`), or ends it where it may not;
2. the blocks — where each request's slots cross a block boundary, and, for
   sliding-window layers, the pages freed as the window passes one; the run ends
   before the pool would run out;
3. the costs — one vectorised call of the cost model on the steps' work
   (`decode_work` for decodes alone, whose rows share their counts), priced only as
   far as the horizon needs (`_step_timing`); the run ends before the horizon, and
   before the first step that starts once a prefix on the wire has landed —

unless the call whose prefix lands may join the run there: the step that takes its
KV in would find the ranks steady, the call's prompt chunks to run (a call moved to
another rank, its prefix fetched while the rank's other calls decode). Then the run
is planned again with it joining at that step (`_join_landing`), the steps before it
costing what they cost in the run cut there: one run where there were two.

What it returns is a `DecodeRun` (`decode_run.py`), which plays the plan back. A run
an arrival cut leaves what it had planned past the cut (`RunRest`); the next run
takes it where it continues exactly, and redoes only steps 2 and 3's bounds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numba import njit

from labkit.engine.chunk_run import RunTokens, plan_tokens
from labkit.engine.decode_run import DecodeRun, RunRest
from labkit.engine.step_work import StepTiming, StepWork, rank_sums


def accepted_before(step_index: int, steps: int, acceptance) -> np.ndarray:
    """cum[j] = tokens accepted in steps step_index .. step_index + j - 1 (A(x)=floor(x p/q)).
    It depends on step_index only through step_index mod q (floor((mq + x) p/q) = mp +
    floor(x p/q)), so the few distinct arrays are made once (read-only, shared)."""
    p, q = acceptance.numerator, acceptance.denominator
    return _accepted(step_index % q, steps, p, q)


@functools.lru_cache(maxsize=256)
def _accepted(phase: int, steps: int, p: int, q: int) -> np.ndarray:
    x = np.arange(phase, phase + steps + 1, dtype=np.int64)
    total = (x * p) // q
    cum = total - total[0]
    cum.flags.writeable = False
    return cum


def plan_decode_run(schedulers, step_index: int, acceptance, config, cost_model,
                    lockstep: bool, now: float, horizon: float,
                    max_steps: int, step_guess_s: float = 0.0,
                    scheduled: bool = False, rest: RunRest | None = None,
                    min_run_steps: int | None = None, leave: bool = False) -> DecodeRun | None:
    """Plan up to max_steps steady steps starting at `now` (decodes, and per rank at most
    one prompt continued chunk by chunk: `chunk_run.py`), or None. Requests
    whose prefix KV is still on the wire sit the run out; it ends before the first
    step that starts once one of them has landed (that step schedules it) — unless the
    run can go on with it (`_join_landing`; `min_run_steps`: where the instance plans a
    run rather than a single step, `Instance.plan_next`; None: never).
    `step_guess_s` (a recent step's duration, 0: none) only saves work: the cost of
    steps past the horizon is not computed. `scheduled`: the schedulers have just
    scheduled step 0 (`Instance._plan_step`): its blocks are allocated and its chunks
    registered, so the run starts with them done (None if step 0 would need more).
    `rest`: the steps a cut run had planned from here (`RunRest`), taken if they fit.
    `leave`: a request that finishes may leave the run (`decode_run.py`)."""
    pairs, rank_of, wire = [], [], []
    for rank, s in enumerate(schedulers):
        for r in s.running:
            if s.on_the_wire(r):
                wire.append((rank, r))
            else:
                pairs.append((s, r))
                rank_of.append(rank)
    if not pairs:
        return None
    if any(s.kv.tail_is_shared(r) for s, r in pairs):
        return None  # a copy-on-write is due: let a normal step do it
    landing = min((r.kv_ready_s for _, r in wire), default=np.inf)
    plan = _Planner(schedulers, step_index, acceptance, config, cost_model, lockstep, now,
                    horizon, max_steps, step_guess_s, scheduled, leave)
    if rest is not None and rest.continues(pairs, step_index, now):
        tokens = RunTokens(rest.held, rest.new, None, len(rest.start), rest.finishes,
                           done=_leaving(rest.new))
        planned = plan.plan(pairs, rank_of, tokens, landing, priced=(rest.timing, rest.work))
    else:
        planned = plan.plan(pairs, rank_of, plan.tokens(pairs, rank_of), landing)
    if planned is None:
        return None
    if plan.cut_by_landing and len(wire) == 1 and min_run_steps is not None:
        joined = _join_landing(plan, planned, pairs, rank_of, *wire[0], min_run_steps)
        if joined is not None:
            return joined  # (the cut run is never built)
    return planned.build()


def _join_landing(plan, cut: _Planned, pairs, rank_of, rank: int, req,
                  min_run_steps: int) -> DecodeRun | None:
    """The run `cut` where `req`'s prefix KV lands (step L), planned on with req from L,
    as the instance would plan it then (None where it would not, or not as a run).

    At step L the rank takes the landed KV in and, req being its last request, may run
    its prompt's chunks in a run (`Scheduler.may_join_run`); the run before L is decodes
    alone, which req's landing does not change, and the instance would plan a run at L
    (`min_run_steps`). So the steps planned then are those a run planned now with req
    sitting out until L plans (`plan_tokens`' `join`), and steps before L cost what
    they cost in the run cut there."""
    steps = cut.steps
    scheduler = plan.schedulers[rank]
    if cut.chunks or not scheduler.may_join_run(req) or scheduler.kv.tail_is_shared(req) \
            or not plan.horizon - cut.end > min_run_steps * float(cut.timing.duration[steps - 1]):
        return None
    at = sum(1 for r in rank_of if r <= rank)  # after its rank's running requests
    pairs = pairs[:at] + [(scheduler, req)] + pairs[at:]
    rank_of = rank_of[:at] + [rank] + rank_of[at:]
    tokens = plan.tokens(pairs, rank_of, join=(at, steps))
    if tokens is None:
        return None
    joined = plan.plan(pairs, rank_of, tokens, np.inf, known=cut.timing.head(steps))
    return joined.build() if joined is not None and joined.steps > steps else None


@dataclass(slots=True)
class _Planned:
    """A run planned (`_Planner.plan`), not yet built: `build` makes its DecodeRun. A
    run cut where KV on the wire lands is not built where the run that goes on with the
    call is (`_join_landing`)."""
    steps: int  # the steps kept
    end: float  # when the last of them ends
    timing: StepTiming  # the steps priced (those kept first)
    chunks: bool  # some steps carry prefill chunks
    build: Callable[[], DecodeRun]


class _Planner:
    """What `plan_decode_run` plans a run from, and how: its tokens (`plan_tokens`),
    then blocks, costs and bounds (`plan`)."""

    def __init__(self, schedulers, step_index: int, acceptance, config, cost_model,
                 lockstep: bool, now: float, horizon: float, max_steps: int,
                 step_guess_s: float, scheduled: bool, leave: bool = False) -> None:
        self.schedulers, self.step_index, self.config = schedulers, step_index, config
        self.cost_model, self.lockstep = cost_model, lockstep
        self.now, self.horizon, self.max_steps = now, horizon, max_steps
        self.step_guess_s, self.scheduled = step_guess_s, scheduled
        self.leave = leave
        self.cum = accepted_before(step_index, max_steps, acceptance)
        self.cut_by_landing = False  # the last run planned ends where KV on the wire lands
        # each rank's free and used blocks before step 0 (the same for every run planned
        # here: planning takes none)
        pools = [s.kv.pool for s in schedulers]
        self.free = np.array([p.num_free for p in pools], dtype=np.int64)
        self.used0 = np.array([p.num_used for p in pools], dtype=np.int64)

    def tokens(self, pairs, rank_of, join=None) -> RunTokens | None:
        return plan_tokens(pairs, rank_of, self.step_index, self.cum, self.config,
                           self.max_steps, join, self.leave)

    def plan(self, pairs, rank_of, tokens: RunTokens | None, landing: float,
             priced=None, known=None) -> _Planned | None:
        """The run of these tokens: blocks, costs, bounds. `priced`: (timing, work) of
        its steps, from a cut run's rest; `known`: the timing of its first steps (a
        run it continues, `_join_landing`)."""
        schedulers, config, cost_model = self.schedulers, self.config, self.cost_model
        if tokens is None or (tokens.prefill is not None
                              and not getattr(cost_model, "prices_chunk_rows", True)):
            return None
        k, finishes = tokens.steps, tokens.finishes
        held, new = tokens.held, tokens.new
        width = config.tokens_per_decode_step

        # Blocks each request takes when step j starts: its slots are held + new tokens.
        have = np.array([s.kv.tables[r.request_id].n for s, r in pairs], dtype=np.int64)
        net = _blocks_taken(held, new, have, schedulers[0].kv.block_size)  # (n, k)
        calls = net > 0
        if schedulers[0].kv.window is not None:
            slid = _window_slides(pairs, held[:, :k])
            if slid is None:
                return None  # a window page is shared: its release is not ours to plan
            if tokens.done is not None:  # one that has left frees its pages as it finishes
                slid[np.arange(k)[None, :] >= tokens.done[:, None]] = 0
            pages = schedulers[0].kv.window.pages_per_block
            net, calls = net * (1 + pages) - slid * pages, calls | (slid > 0)
        if self.scheduled and calls[:, 0].any():
            return None  # step 0's KV work is not all done: not the step scheduled
        taken, fit = _taken_by_rank(net, np.asarray(rank_of, dtype=np.int64), self.free)  # (k, R)
        if fit < k:
            k, finishes = fit, False
        done = tokens.done  # some leave the run before its end (`decode_run.py`)
        if done is not None and not self.leave and int(done.min()) < k:
            k, finishes = int(done.min()), True  # (a cut run's rest, planned with leave)
        if k < 1 or (known is not None and k <= len(known.duration)):
            return None
        stops = () if done is None else tuple(sorted(set(done[done < k].tolist())))

        prefill, chunk_end = None, 0  # the steps before chunk_end carry prefill chunks
        if tokens.prefill is not None:
            prefill = tokens.prefill[:, :k]
            chunk_end = max(_chunk_end(prefill, new[:, :k], done),
                            tokens.land_step + 1 if tokens.lands else 0)

        # Cost of each step, then cut before the first step ending at or after the horizon.
        ranks = len(schedulers)
        if priced is not None:
            timing, work = priced[0].head(k), priced[1].head(k)
        else:
            splits = (chunk_end, *stops)  # where the steps' counts change
            if tokens.prefill is None:
                rows, splits = decode_rows(rank_of, ranks, held[:, 0], done, self.cum, width)
            else:
                whole = StepWork.from_entries(rank_of, ranks, held[:, :k], new[:, :k], prefill)
                rows = whole.rows
            prices_whole = getattr(cost_model, "prices_runs_whole", None)
            known_parts = known
            if prices_whole is not None and prices_whole(self.lockstep, ranks):
                # (the known steps too: a step's cost is its row's alone, so priced again
                # they cost what they cost, for less than joining their timing to the rest's)
                splits, known_parts = (), None
            # (steps starting once KV on the wire lands are cut too: priced for nothing)
            timing, work = _step_timing(cost_model, self.lockstep, rows, k, self.now,
                                        min(self.horizon, landing), self.step_guess_s,
                                        splits, known_parts)
        times = _running_sum(self.now, timing.duration)  # each step starts where the last ended
        start, ends = times[:-1], times[1:]
        within = int(ends.searchsorted(self.horizon, side="left"))  # steps ending < horizon
        landed = int(start.searchsorted(landing, side="left"))  # steps starting before it
        self.cut_by_landing = landed < min(within, k)
        within = min(within, landed)
        if within < 1:
            return None

        def build() -> DecodeRun:
            kv_used = self.used0[None, :] + taken[:k]
            run = DecodeRun(start, timing, work, held[:, : k + 1], new[:, :k], prefill, pairs,
                            net[:, :k], calls[:, :k], kv_used, finishes, tokens.lands,
                            chunk_end, allocated=int(self.scheduled),
                            land_step=tokens.land_step, stops=stops)
            run.truncate(within)
            return run

        end = float(times[within - 1] + timing.duration[within - 1])  # (as DecodeRun.end)
        return _Planned(within, end, timing, prefill is not None, build)


def _step_timing(cost_model, lockstep: bool, rows, k: int, now: float, horizon: float,
                 step_guess_s: float, splits=(), known=None):
    """The cost of the k steps whose StepWork `rows(a, b)` gives (steps [a, b)), or of
    a first part of them that ends at or after the horizon (what lies beyond is cut
    from the run anyway), and the StepWork of the steps costed. The part is sized from
    a recent step's duration; if it falls short of the horizon, the rest is costed too.
    The steps between `splits` (the end of the prefill chunks, requests leaving) are
    costed apart: steps alike are then costed as one row (`LayerStepModel`'s memo; a
    model that prices such a run as cheaply whole, `prices_runs_whole`, gets none). A
    step's cost depends on its own row of the work alone, so the parts are the rows of
    the whole. `known`: the timing of the first steps, costed already."""
    done = 0 if known is None else len(known.duration)
    first = k
    if step_guess_s > 0 and np.isfinite(horizon):
        first = max(1, min(k, int((horizon - now) / step_guess_s * 1.25) + 8))
    bounds = sorted({b for b in (0, *(min(s, k) for s in splits), first, k) if b > done}
                    | {done})
    parts = [] if known is None else [known]
    for a, b in zip(bounds, bounds[1:]):
        work = rows(a, b)
        parts.append(cost_model.step_timing(work, lockstep))
        # as plan_decode_run finds the steps' ends (same sums, same rounding)
        if b < k and _running_sum(now, np.concatenate([p.duration for p in parts]))[-1] \
                >= horizon:
            break
    if len(parts) == 1:
        return parts[0], work  # rows(0, b), built once
    timing = StepTiming.joined(parts)
    return timing, rows(0, b)


@njit(cache=True)
def _running_sum(now: float, durations: np.ndarray) -> np.ndarray:
    """[now, now + d0, (now + d0) + d1, ...]: the steps' start times and, last, the end
    of the last (added one by one, so a step's end is the same float however many
    steps are summed)."""
    times = np.empty(len(durations) + 1)
    times[0] = now
    for j in range(len(durations)):
        times[j + 1] = times[j] + durations[j]
    return times


@njit("(int64[:, :], int64[:, :], int64[:], int64)", cache=True)  # (any layout: one copy)
def _blocks_taken(held, new, have, block_size: int):
    """(n, k) blocks request i takes when step j starts: what its slots then (held +
    new tokens, if it is in the step) need beyond the blocks it holds (`have` before
    step 0)."""
    n, k = new.shape
    out = np.zeros((n, k), dtype=np.int64)
    for i in range(n):
        blocks = have[i]
        for j in range(k):
            if new[i, j] > 0:
                need = -(-(held[i, j] + new[i, j]) // block_size)
                if need > blocks:
                    out[i, j] = need - blocks
                    blocks = need
    return out


@njit(cache=True)
def _taken_by_rank(net, rank_of, free):
    """((k, R) blocks each rank has taken by the end of step j's start, how many steps
    fit: the first in which a request's allocation would find its rank short is not
    one). The requests allocate one after the other, in the run's order: where some
    free sliding-window pages as they go, one before them may be short although the
    step as a whole frees more than it takes."""
    n, k = net.shape
    taken = np.zeros((k, len(free)), dtype=np.int64)
    fit = k
    for j in range(k):
        for r in range(len(free)):
            taken[j, r] = taken[j - 1, r] if j else 0
        for i in range(n):
            r = rank_of[i]
            taken[j, r] += net[i, j]
            if taken[j, r] > free[r] and fit == k:
                fit = j
    return taken, fit


@njit(cache=True)
def _chunk_end(prefill, new, done) -> int:
    """The steps up to the last with a prefill chunk or a request out of it that has
    not left the run (a deferred chunk, KV on the wire; `done`: the steps each is in
    before it leaves, None: all); 0 if none."""
    n, k = new.shape
    for j in range(k - 1, -1, -1):
        for i in range(n):
            if prefill[i, j] or (new[i, j] == 0 and (done is None or j < done[i])):
                return j + 1
    return 0


def _window_slides(pairs, computed: np.ndarray) -> np.ndarray | None:
    """(n, k) logical blocks whose window pages request i frees when step j starts
    (`computed[i, j]` tokens by then); None if a window page is shared, as then
    freeing it may not return it to the pool."""
    windows = [s.kv.window for s, _ in pairs]  # each request's rank's own
    tables = [w.tables[r.request_id] for w, (_, r) in zip(windows, pairs)]
    if any((w.pool.ref_count[t.live()] > 1).any() for w, t in zip(windows, tables)):
        return None
    window = windows[0]  # (every rank's has the same window and page size)
    live = np.array([t.first_live for t in tables], dtype=np.int64)[:, None]
    first = np.maximum(np.maximum(0, computed - window.window + 1) // window.block_size, live)
    return np.diff(np.concatenate([live, first], axis=1), axis=1)


def _leaving(new: np.ndarray) -> np.ndarray | None:
    """For steps of decodes alone: the steps each request decodes in (it has left the
    run after them), or None where every request decodes in all of them."""
    if new[:, -1].all():
        return None
    return (new > 0).sum(axis=1)


def decode_rows(rank_of, ranks: int, held0: np.ndarray, done: np.ndarray | None,
                cum: np.ndarray, width: int):
    """(rows(a, b): the StepWork of steps [a, b) of a run of decodes, the steps where
    its counts change). Request i holds held0[i] tokens before step 0, gains cum[j]
    by step j and decodes in its first done[i] steps (None: in all of them): between
    two leavings the ranks' counts stay, and `decode_work` makes the rows."""
    if done is None:
        counts = np.bincount(rank_of, minlength=ranks).astype(np.int64)
        base = rank_sums(held0, rank_of, ranks)
        return (lambda a, b: decode_work(counts, base, cum[a:b], width)), ()
    rank_of = np.asarray(rank_of, dtype=np.int64)
    bounds = [0, *sorted(set(done.tolist()))]
    parts = []  # (first step, stop, counts, summed contexts before step 0)
    for lo, hi in zip(bounds, bounds[1:]):
        alive = done > lo
        parts.append((lo, hi, np.bincount(rank_of[alive], minlength=ranks).astype(np.int64),
                      rank_sums(held0[alive], rank_of[alive], ranks)))

    def rows(a: int, b: int) -> StepWork:
        works = [decode_work(counts, base, cum[max(a, lo) : min(b, hi)], width)
                 for lo, hi, counts, base in parts if lo < b and hi > a]
        return works[0] if len(works) == 1 else StepWork.joined(works)

    return rows, tuple(bounds[1:-1])


def decode_work(counts: np.ndarray, base: np.ndarray, cum: np.ndarray, width: int) -> StepWork:
    """StepWork of k decode steps for ranks with `counts` requests of summed context `base`."""
    ctx, decode_tokens, num_decode_reqs, kv_read, decode_pairs, zeros, idle = \
        _decode_columns(counts, base, cum, width)
    return StepWork(prefill_tokens=zeros, decode_tokens=decode_tokens, num_prefill_reqs=zeros,
                    num_decode_reqs=num_decode_reqs, kv_read_tokens=kv_read,
                    prefill_pairs=zeros, decode_pairs=decode_pairs, idle=idle,
                    decode_context=ctx, same_counts=True)


@njit(cache=True)
def _decode_columns(counts, base, cum, width: int):
    """`decode_work`'s (k, R) columns in one pass: each step's summed contexts (a rank's
    requests each gained cum[j]), decode tokens, decoding requests, KV read, decode
    query-key pairs, zeros (no prefill), idle ranks."""
    k, ranks = len(cum), len(counts)
    ctx = np.empty((k, ranks), dtype=np.int64)
    decode_tokens = np.empty((k, ranks), dtype=np.int64)
    num_decode_reqs = np.empty((k, ranks), dtype=np.int64)
    kv_read = np.empty((k, ranks), dtype=np.int64)
    pairs = np.empty((k, ranks), dtype=np.int64)
    idle = np.empty((k, ranks), dtype=np.bool_)
    triangle = width * (width + 1) // 2  # a request's own new tokens' pairs
    for j in range(k):
        for r in range(ranks):
            n = counts[r]
            c = base[r] + n * cum[j]
            ctx[j, r] = c
            decode_tokens[j, r] = n * width
            num_decode_reqs[j, r] = n
            kv_read[j, r] = c + n * width
            pairs[j, r] = width * c + n * triangle
            idle[j, r] = n == 0
    return ctx, decode_tokens, num_decode_reqs, kv_read, pairs, np.zeros((k, ranks), np.int64), idle
