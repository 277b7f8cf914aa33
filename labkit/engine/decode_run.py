"""Fast-forward: simulate a run of steady decode steps in one go.

Most steps of an agentic replay are alike: every running request decodes, nobody
waits, nothing is admitted. Until a request finishes or a new one arrives, each such
step has the same shape; only the contexts grow by the tokens accepted. Simulating
them one by one costs Python work per request per step; a `DecodeRun` plans k of them
at once with numpy:

- accepted tokens per step follow the instance's deterministic acceptance counter,
  the same for every request in a step, so after j steps each request has gained
  ``cum[j]`` tokens;
- the steps' costs are one vectorised call of the cost model on (k, ranks) arrays;
- the block allocations the steps need are found arithmetically (where each
  request's slot count crosses a block boundary), and so are, for sliding-window
  layers, the pages freed as the window passes a block boundary.

A run is then *played back* lazily, exactly as step-by-step simulation would have
done it: the allocations of step j happen when step j starts, its tokens are emitted
(and full blocks cached) when it ends. Whatever looks at the engine in the middle of
a run — an arrival being routed — first calls `sync(t)`, which plays the run up to t
and cuts it after the step in progress, so the newcomer is scheduled in the next step
just as it would have been. The run also stops at the first step that finishes a
request, before the next known arrival, and where the pool would run out of blocks.
A rank's KV work in a playback is done in one batch where that is exact
(`kv/batch_play.py`). A fast-forwarded replay is identical to a step-by-step one, bit
for bit; `tests/engine/test_fast_forward.py` checks exactly that.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from labkit.engine.kv.batch_play import play_run_in_batches
from labkit.engine.step_work import StepWork


def accepted_before(step_index: int, steps: int, acceptance) -> np.ndarray:
    """cum[j] = tokens accepted in steps step_index .. step_index + j - 1 (A(x)=floor(x p/q))."""
    p, q = acceptance.numerator, acceptance.denominator
    x = np.arange(step_index, step_index + steps + 1, dtype=np.int64)
    total = (x * p) // q
    return total - total[0]


@dataclass(slots=True)
class DecodeRun:
    start: np.ndarray  # (k,) step start times
    timing: object  # StepTiming over (k, R)
    work: StepWork
    cum: np.ndarray  # (k+1,) tokens each request accepts before step j
    pairs: list  # (scheduler, request) in step order: by rank, then running order
    new_blocks: np.ndarray  # (n, k) pool blocks request i takes (net) when step j starts
    kv_calls: np.ndarray  # (n, k) bool: step j of request i allocates or slides
    kv_used: np.ndarray  # (k, R) blocks in use during each step
    finishes: bool  # the last step finishes a request
    width: int  # tokens per decode step (1 + drafts)
    allocated: int = 0  # steps whose allocations are done
    committed: int = 0  # steps whose outputs are applied
    # the latest playback: its first step, each request's tokens before it and after
    # each of its steps (n, steps) — what `tokens` reports
    played: tuple = (0, None, None)

    @property
    def steps(self) -> int:
        return len(self.start)

    @property
    def ends(self) -> np.ndarray:
        return self.start + self.timing.duration

    @property
    def end(self) -> float:
        return float(self.start[-1] + self.timing.duration[-1])

    # ------------------------------------------------------------- playback
    def play(self, alloc_stop: int, commit_stop: int) -> list:
        """Play the run forward: allocations of steps before `alloc_stop` (done when a
        step starts), cache registrations and tokens of steps before `commit_stop`
        (when it ends), in the order step-by-step simulation does them: at each step
        boundary first the ending step's registrations, then the next one's
        allocations. Returns the (scheduler, request) pairs that finished."""
        first = self.committed
        commit_stop = max(commit_stop, first)
        alloc_stop = max(alloc_stop, commit_stop, self.allocated)
        ends = self.ends
        before = np.array([r.num_computed_tokens for _, r in self.pairs], dtype=np.int64)
        gained = np.minimum(self.cum[commit_stop] - self.cum[first],
                            [r.remaining_output_tokens for _, r in self.pairs])
        after = before[:, None] + np.minimum(
            self.cum[None, first + 1 : commit_stop + 1] - self.cum[first], gained[:, None])
        full = np.concatenate([before[:, None], after], axis=1) // self.pairs[0][0].kv.block_size
        fills = np.diff(full, axis=1) != 0  # (n, commit_stop - first): step j fills a block
        left = play_run_in_batches(self, first, alloc_stop, before, after, fills, ends)
        if left:
            self._play_in_order(first, alloc_stop, before, after, fills, ends, left)
        self.allocated = alloc_stop
        self.played = (first, before, after)
        return self._emit_tokens(first, commit_stop, gained, ends)

    def _play_in_order(self, first: int, alloc_stop: int, before, after, fills, ends,
                       rows: list) -> None:
        """The KV work of requests `rows` in the steps being played, one call per
        request and step, in step-by-step order: at each step boundary first the
        ending step's registrations, then the next one's allocations."""
        events = []  # (boundary, 0 = register / 1 = allocate, request, step)
        req_idx, step_idx = np.nonzero(self.kv_calls[rows, self.allocated : alloc_stop])
        events += [(j + self.allocated, 1, rows[i], j + self.allocated)
                   for i, j in zip(req_idx.tolist(), step_idx.tolist())]
        req_idx, step_idx = np.nonzero(fills[rows])
        events += [(first + j + 1, 0, rows[i], first + j)
                   for i, j in zip(req_idx.tolist(), step_idx.tolist())]
        for _, kind, i, j in sorted(events):
            scheduler, req = self.pairs[i]
            if kind == 1:
                req.num_computed_tokens = int(before[i] + self.cum[j] - self.cum[first])
                scheduler.kv.set_time(float(self.start[j]))
                if not scheduler.kv.allocate(req, self.width):
                    raise RuntimeError("fast-forward planned an allocation the pool "
                                       "cannot serve")
            else:
                req.num_computed_tokens = int(after[i, j - first])
                scheduler.kv.set_time(float(ends[j]))
                scheduler.kv.cache_full_blocks(req)
            req.num_computed_tokens = int(before[i])

    def tokens(self, first: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(steps, requests) arrays for steps [first, stop) of the latest playback:
        each request's tokens with KV before the step and after it."""
        start, before, after = self.played
        held = np.concatenate([before[:, None], after], axis=1).T
        return held[first - start : stop - start], held[first - start + 1 : stop - start + 1]

    def _emit_tokens(self, first: int, stop: int, gained: np.ndarray, ends) -> list:
        if stop <= first:
            return []
        gaps = np.diff(ends[first:stop]).tolist()
        finished = []
        for (scheduler, req), n in zip(self.pairs, gained.tolist()):
            req.itl.append(float(ends[first]) - req.last_token_s)
            req.itl.extend(gaps)
            req.num_output_tokens += n
            req.num_computed_tokens += n
            req.last_token_s = float(ends[stop - 1])
            if req.remaining_output_tokens <= 0:
                finished.append((scheduler, req))
        self.committed = stop
        return finished

    def truncate(self, steps: int) -> None:
        """Keep only the first `steps` steps (the rest will be planned again)."""
        if steps >= self.steps:
            return
        self.start = self.start[:steps]
        self.timing = _head(self.timing, steps)
        self.work = self.work.head(steps)
        self.kv_used = self.kv_used[:steps]
        self.new_blocks = self.new_blocks[:, :steps]
        self.kv_calls = self.kv_calls[:, :steps]
        self.cum = self.cum[: steps + 1]
        self.finishes = False


def plan_decode_run(schedulers, step_index: int, acceptance, config, cost_model,
                    lockstep: bool, now: float, horizon: float,
                    max_steps: int, step_guess_s: float = 0.0) -> DecodeRun | None:
    """Plan up to max_steps steady decode steps starting at `now`, or None. Requests
    whose prefix KV is still on the wire sit the run out; it ends before the first
    step that starts once one of them has landed (that step schedules it).
    `step_guess_s` (a recent step's duration, 0: none) only saves work: the cost of
    steps past the horizon is not computed."""
    pairs, rank_of, landing = [], [], np.inf
    for rank, s in enumerate(schedulers):
        for r in s.running:
            if s.on_the_wire(r):
                landing = min(landing, r.kv_ready_s)
            else:
                pairs.append((s, r))
                rank_of.append(rank)
    if not pairs:
        return None
    if any(s.kv.tail_is_shared(r) for s, r in pairs):
        return None  # a copy-on-write is due: let a normal step do it
    width = config.tokens_per_decode_step
    cum = accepted_before(step_index, max_steps, acceptance)

    # The first request to finish ends in the step after which cum reaches its remainder.
    remaining = min(r.remaining_output_tokens for _, r in pairs)
    first_done = int(np.searchsorted(cum, remaining, side="left"))
    k, finishes = (first_done, True) if first_done <= max_steps else (max_steps, False)

    # Blocks each request must hold during step j: its slots are computed + width.
    computed = np.array([r.num_computed_tokens for _, r in pairs], dtype=np.int64)
    have = np.array([s.kv.tables[r.request_id].n for s, r in pairs], dtype=np.int64)
    block_size = schedulers[0].kv.block_size
    need = -(-(computed[:, None] + cum[None, :k] + width) // block_size)  # (n, k)
    held = np.maximum.accumulate(np.maximum(need, have[:, None]), axis=1)
    new = np.diff(np.concatenate([have[:, None], held], axis=1), axis=1)  # (n, k)
    net, calls = new, new > 0
    if schedulers[0].kv.window is not None:
        slid = _window_slides(pairs, computed[:, None] + cum[None, :k])
        if slid is None:
            return None  # a window page is shared: its release is not ours to plan
        pages = schedulers[0].kv.window.pages_per_block
        net, calls = new * (1 + pages) - slid * pages, calls | (slid > 0)
    per_rank = _rank_sums(net.T, rank_of, len(schedulers))  # (k, R)
    free = np.array([s.kv.pool.num_free for s in schedulers], dtype=np.int64)
    fits = (np.cumsum(per_rank, axis=0) <= free[None, :]).all(axis=1)
    if not fits.all():
        k, finishes = int(np.argmin(fits)), False
        if k < 1:
            return None

    # Cost of each step, then cut before the first step ending at or after the horizon.
    counts = np.bincount(rank_of, minlength=len(schedulers)).astype(np.int64)
    base = _rank_sums(computed, rank_of, len(schedulers))
    timing, work = _step_timing(cost_model, lockstep, counts, base, cum[:k], width, now,
                                horizon, step_guess_s)
    ends = np.cumsum(np.concatenate([[now], timing.duration]))[1:]
    within = int(np.searchsorted(ends, horizon, side="left"))  # steps ending < horizon
    start = np.concatenate([[now], ends[:-1]])
    within = min(within, int(np.searchsorted(start, landing, side="left")))
    if within < 1:
        return None
    used0 = np.array([s.kv.pool.num_used for s in schedulers], dtype=np.int64)
    kv_used = used0[None, :] + np.cumsum(per_rank[:k], axis=0)
    run = DecodeRun(start, timing, work, cum[: k + 1], pairs, net[:, :k], calls[:, :k],
                    kv_used, finishes, width)
    run.truncate(within)
    return run


def _step_timing(cost_model, lockstep: bool, counts, base, cum, width: int, now: float,
                 horizon: float, step_guess_s: float):
    """The cost of the decode steps `cum` describes, or of a first part of them that
    ends at or after the horizon (what lies beyond is cut from the run anyway), and
    the StepWork of the steps costed. The part is sized from a recent step's
    duration; if it falls short of the horizon, the rest is costed too. A step's cost
    depends on its own row of the work alone, so the two parts are the rows of the
    whole."""
    k = len(cum)
    first = k
    if step_guess_s > 0 and np.isfinite(horizon):
        first = max(1, min(k, int((horizon - now) / step_guess_s * 1.25) + 8))
    work = decode_work(counts, base, cum[:first], width)
    timing = cost_model.step_timing(work, lockstep)
    # as plan_decode_run finds the steps' ends (same sums, same rounding)
    if first == k or np.cumsum(np.concatenate([[now], timing.duration]))[-1] >= horizon:
        return timing, work
    rest = cost_model.step_timing(decode_work(counts, base, cum[first:], width), lockstep)
    timing = type(timing)(*(np.concatenate([a, b]) for a, b in zip(_fields(timing),
                                                                   _fields(rest))))
    return timing, decode_work(counts, base, cum, width)


def _rank_sums(values: np.ndarray, rank_of: list, ranks: int) -> np.ndarray:
    """values summed over the requests of each rank (the last axis: requests -> ranks);
    integer sums, so the order of the additions does not matter."""
    if ranks == 1:
        return values.sum(axis=-1, keepdims=True)
    out = np.zeros(values.shape[:-1] + (ranks,), dtype=values.dtype)
    np.add.at(out, (..., np.asarray(rank_of)), values)
    return out


def _fields(timing) -> tuple:
    return (timing.busy, timing.compute, timing.comm, timing.duration,
            timing.temporary_kv_bytes)


def _window_slides(pairs, computed: np.ndarray) -> np.ndarray | None:
    """(n, k) logical blocks whose window pages request i frees when step j starts
    (`computed[i, j]` tokens by then); None if a window page is shared, as then
    freeing it may not return it to the pool."""
    window = pairs[0][0].kv.window
    tables = [window.tables[r.request_id] for _, r in pairs]
    if any((window.pool.ref_count[t.live()] > 1).any() for t in tables):
        return None
    live = np.array([t.first_live for t in tables], dtype=np.int64)[:, None]
    first = np.maximum(np.maximum(0, computed - window.window + 1) // window.block_size, live)
    return np.diff(np.concatenate([live, first], axis=1), axis=1)


def decode_work(counts: np.ndarray, base: np.ndarray, cum: np.ndarray, width: int) -> StepWork:
    """StepWork of k decode steps for ranks with `counts` requests of summed context `base`."""
    ctx = base[None, :] + counts[None, :] * cum[:, None]  # (k, R) summed contexts
    zeros = np.zeros_like(ctx)
    k = len(cum)
    return StepWork(
        prefill_tokens=zeros,
        decode_tokens=np.repeat((counts * width)[None, :], k, axis=0),
        num_prefill_reqs=zeros,
        num_decode_reqs=np.repeat(counts[None, :], k, axis=0),
        kv_read_tokens=ctx + counts[None, :] * width,
        prefill_pairs=zeros,
        decode_pairs=width * ctx + counts[None, :] * (width * (width + 1) // 2),
        idle=np.repeat((counts == 0)[None, :], k, axis=0),
        decode_context=ctx,
    )


def _head(timing, k: int):
    """The first k steps of a StepTiming."""
    return type(timing)(*(a[:k] for a in _fields(timing)))
