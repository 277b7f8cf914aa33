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

A run may also carry a long prompt's **prefill chunks** (`chunk_run.py`): per rank one
request still computing its prompt, chunk by chunk, until the step that ends it emits
its first token; then it decodes with the others. Its entries are held, like every
request's, as (request, step) arrays of tokens — those with KV before each step and
those computed in it — from which the allocations, the cost model's rows and the
playback follow; its chunks' blocks are registered when their step starts, as
`Scheduler.schedule` registers them, and its steps are played call by call.

A run may also begin with a step the schedulers have just scheduled: one that admits
a call (its prefix KV put on the wire, or its first prompt chunk) and leaves the ranks
steady (`Instance._run_from_step`). Its KV work is done then, so the run starts past it
(`allocated`); it is taken only where its step 0 is exactly the scheduled batches
(`starts_as`). When an arrival cut the run before it and the newcomer's prefix KV went
on the wire, the new run has the same requests decoding as the cut one had planned:
it takes over the steps planned past the cut, costs included (`RunRest`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from labkit.engine.chunk_run import RunTokens, plan_tokens
from labkit.engine.events import FirstToken
from labkit.engine.kv.batch_play import play_run_in_batches
from labkit.engine.step_work import StepWork, rank_sums


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
    held: np.ndarray  # (n, k+1) tokens request i holds KV for before step j
    new: np.ndarray  # (n, k) tokens request i computes in step j (0: not scheduled)
    prefill: np.ndarray | None  # (n, k) bool: a prefill chunk (None: all decode)
    pairs: list  # (scheduler, request) in step order: by rank, then running order
    new_blocks: np.ndarray  # (n, k) pool blocks request i takes (net) when step j starts
    kv_calls: np.ndarray  # (n, k) bool: step j of request i allocates or slides
    kv_used: np.ndarray  # (k, R) blocks in use during each step
    finishes: bool  # the last step finishes a request
    lands: tuple = ()  # rows whose landed prefix KV step 0 takes in (`chunk_run.py`)
    chunk_end: int = 0  # the steps before it carry prefill chunks (or sit one out)
    allocated: int = 0  # steps whose allocations are done
    committed: int = 0  # steps whose outputs are applied

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
        allocations (and its prefill chunks' registrations). Returns the (scheduler,
        request) pairs that finished."""
        split = self.chunk_end
        if self.committed < split < max(alloc_stop, commit_stop):
            # the steps with prefill chunks play call by call, those after may batch
            finished = self._play(min(alloc_stop, split), min(commit_stop, split))
            return finished + self._play(alloc_stop, commit_stop)
        return self._play(alloc_stop, commit_stop)

    def _play(self, alloc_stop: int, commit_stop: int) -> list:
        first = self.committed
        commit_stop = max(commit_stop, first)
        alloc_stop = max(alloc_stop, commit_stop, self.allocated)
        ends = self.ends
        before = self.held[:, first]
        after = self.held[:, first + 1 : commit_stop + 1]
        full = self.held[:, first : commit_stop + 1] // self.pairs[0][0].kv.block_size
        fills = full[:, 1:] != full[:, :-1]  # (n, commit_stop - first): step j fills a block
        left = play_run_in_batches(self, first, alloc_stop, after, fills, ends)
        if left:
            self._play_in_order(first, alloc_stop, before, fills, ends, left)
        self.allocated = alloc_stop
        return self._emit_tokens(first, commit_stop, ends)

    def _play_in_order(self, first: int, alloc_stop: int, before, fills, ends,
                       rows: list) -> None:
        """The KV work of requests `rows` in the steps being played, one call per
        request and step, in step-by-step order: at each step boundary first the
        ending step's registrations, then the next one's allocations, then the
        registrations of its prefill chunks (made when the step is scheduled)."""
        # (boundary, 0 = cache / 1 = allocate / 2 = register, request, before its
        # allocation: a landed prefix taken in, step)
        events = []
        req_idx, step_idx = np.nonzero(self.kv_calls[rows, self.allocated : alloc_stop])
        events += [(j + self.allocated, 1, rows[i], 1, j + self.allocated)
                   for i, j in zip(req_idx.tolist(), step_idx.tolist())]
        if self.prefill is not None:
            req_idx, step_idx = np.nonzero(self.prefill[rows, self.allocated : alloc_stop])
            events += [(j + self.allocated, 2, rows[i], 1, j + self.allocated)
                       for i, j in zip(req_idx.tolist(), step_idx.tolist())]
            if self.allocated == 0:
                events += [(0, 1, i, 0, 0) for i in self.lands]
        req_idx, step_idx = np.nonzero(fills[rows])
        events += [(first + j + 1, 0, rows[i], 1, first + j)
                   for i, j in zip(req_idx.tolist(), step_idx.tolist())]
        for _, kind, i, sub, j in sorted(events):
            scheduler, req = self.pairs[i]
            kv = scheduler.kv
            if kind == 0:
                req.num_computed_tokens = int(self.held[i, j + 1])
                kv.set_time(float(ends[j]))
                kv.cache_full_blocks(req)
            else:
                req.num_computed_tokens = int(self.held[i, j])
                kv.set_time(float(self.start[j]))
                n = int(self.new[i, j])
                if sub == 0:  # the copied prefix arrived (`Scheduler._schedule_running`)
                    req.kv_ready_s = 0.0
                    kv.cache_full_blocks(req)
                elif kind == 2:
                    kv.register_blocks(req, req.num_computed_tokens + n)
                elif not kv.allocate(req, n):
                    raise RuntimeError("fast-forward planned an allocation the pool "
                                       "cannot serve")
            req.num_computed_tokens = int(before[i])

    def tokens(self, first: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(steps, requests) arrays for steps [first, stop): each request's tokens with
        KV before the step and after it."""
        return self.held[:, first:stop].T, self.held[:, first + 1 : stop + 1].T

    def _emit_tokens(self, first: int, stop: int, ends) -> list:
        if stop <= first:
            return []
        times = ends[first:stop]
        gaps = (times[1:] - times[:-1]).tolist()
        first_end, last_end = float(times[0]), float(times[-1])
        gained = (self.held[:, stop] - self.held[:, first]).tolist()
        chunked = () if self.prefill is None else (  # not decoding throughout
            self.prefill[:, first:stop] | (self.new[:, first:stop] == 0)).any(axis=1)
        finished = []
        for i, ((scheduler, req), n) in enumerate(zip(self.pairs, gained)):
            if len(chunked) and chunked[i]:
                self._emit_chunked(i, first, stop, ends)
            else:
                req.itl.append(first_end - req.last_token_s)
                req.itl.extend(gaps)
                req.num_output_tokens += n
                req.num_computed_tokens += n
                req.last_token_s = last_end
            if req.remaining_output_tokens <= 0:
                finished.append((scheduler, req))
        self.committed = stop
        return finished

    def _emit_chunked(self, i: int, first: int, stop: int, ends) -> None:
        """Steps [first, stop) of a request that computes prefill chunks in some: what
        `Scheduler.update` does, step by step (the prompt's last chunk emits the first
        token)."""
        scheduler, req = self.pairs[i]
        for j in range(first, stop):
            n, t = int(self.new[i, j]), float(ends[j])
            if n == 0:
                continue  # a deferred chunk: not in the step
            if not self.prefill[i, j]:
                accepted = int(self.held[i, j + 1] - self.held[i, j])
                req.num_computed_tokens += accepted
                req.emit(accepted, t)
                continue
            if req.num_computed_tokens < req.num_prompt_tokens:
                req.num_computed_prefill_tokens += min(
                    n, req.num_prompt_tokens - req.num_computed_tokens)
            req.num_computed_tokens += n
            if req.num_computed_tokens == req.num_tokens:
                if req.emit(1, t) and scheduler.events.wants(FirstToken):
                    scheduler.events.emit(FirstToken(t, req.request_id, scheduler.rank))

    def could_change_lookup(self, scheduler, req, match, now: float) -> bool:
        """Could playing the run up to `now` (`Instance.sync`) change `match`, req's
        prefix on `scheduler`'s rank as played so far? Playing allocates blocks, which
        evicts the least recently freed ones, and registers the blocks the run's requests
        fill (a prefill chunk's, a landed prefix's too); it frees and touches nothing. So
        the match can only shrink, if the allocations reach one of its blocks, or grow,
        if the run caches (or finishes computing) the block after it — which only a
        request whose key there equals req's can do, keys naming their whole prefix."""
        rows = [i for i, (s, _) in enumerate(self.pairs) if s is scheduler]
        pool, m = scheduler.kv.pool, len(match.blocks)
        started = max(1, int(self.start.searchsorted(now, side="left")))
        taken = int(self.new_blocks[rows, self.allocated : started].sum())
        if taken and m and pool.would_take_any(taken, match.blocks):
            return True
        if m >= req.keys.num_blocks:
            return False
        key = req.keys.key(m)
        return pool.cached_block(key) >= 0 or any(
            r.keys is not None and m < r.keys.num_blocks and r.keys.key(m) == key
            for r in (self.pairs[i][1] for i in rows))

    def starts_as(self, batches) -> bool:
        """Is step 0 the step the schedulers scheduled (`batches`, one per rank): the
        same requests in the same order, each with the same tokens over the same
        context, decode or prefill alike? (A deferred chunk sits step 0 out.)"""
        chunk = self.prefill[:, 0].tolist() if self.prefill is not None \
            else [False] * len(self.pairs)
        ours = [(req, n, ctx, not c) for (_, req), n, ctx, c in zip(
            self.pairs, self.new[:, 0].tolist(), self.held[:, 0].tolist(), chunk) if n]
        theirs = [entry for b in batches for entry in zip(
            b.requests, b.num_new_tokens, b.contexts, b.is_decode)]
        return len(ours) == len(theirs) and all(
            a[0] is b[0] and a[1:] == b[1:] for a, b in zip(ours, theirs))

    def rest(self, steps: int, step_index: int) -> RunRest | None:
        """What the run planned after its first `steps` steps (before they are cut off,
        `truncate`), for the run that may take over there (`RunRest`); None where that
        part was not planned as decodes alone. `step_index`: the index of step `steps`."""
        if self.prefill is not None or steps >= self.steps:
            return None
        return RunRest(step_index, self.start[steps:], _rows(self.timing, steps),
                       self.work.rows(steps, self.steps), self.held[:, steps:],
                       self.new[:, steps:], [r for _, r in self.pairs], self.finishes)

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
        self.held = self.held[:, : steps + 1]
        self.new = self.new[:, :steps]
        if self.prefill is not None:
            self.prefill = self.prefill[:, :steps]
        self.chunk_end = min(self.chunk_end, steps)
        self.finishes = False


@dataclass(slots=True)
class RunRest:
    """The steps a run had planned past the point where an arrival cut it: its
    requests' tokens, the steps' work and what they cost. A newcomer whose prefix KV
    goes on the wire sits out until it lands, so the run that starts where the cut one
    ended usually has the same requests, decoding as planned: it takes these steps as
    they are (a step's cost depends on its own row of work alone, and its end is the
    same running sum of durations) and only redoes what the admission changed — the
    blocks free, the landing it must end before (`plan_decode_run`)."""
    step_index: int  # the index of its first step
    start: np.ndarray  # (k,) step start times
    timing: object
    work: StepWork
    held: np.ndarray  # (n, k+1)
    new: np.ndarray  # (n, k)
    requests: list  # in the run's order
    finishes: bool

    def continues(self, pairs, step_index: int, now: float) -> bool:
        """Is this where the run of `pairs` planned at `now`, step `step_index`, starts:
        the same requests, in the same order, each holding the tokens planned?"""
        return (step_index == self.step_index and now == float(self.start[0])
                and len(pairs) == len(self.requests)
                and all(r is mine for (_, r), mine in zip(pairs, self.requests))
                and all(r.num_computed_tokens == n
                        for (_, r), n in zip(pairs, self.held[:, 0].tolist())))


def plan_decode_run(schedulers, step_index: int, acceptance, config, cost_model,
                    lockstep: bool, now: float, horizon: float,
                    max_steps: int, step_guess_s: float = 0.0,
                    scheduled: bool = False, rest: RunRest | None = None) -> DecodeRun | None:
    """Plan up to max_steps steady steps starting at `now` (decodes, and per rank at most
    one prompt continued chunk by chunk: `chunk_run.py`), or None. Requests
    whose prefix KV is still on the wire sit the run out; it ends before the first
    step that starts once one of them has landed (that step schedules it).
    `step_guess_s` (a recent step's duration, 0: none) only saves work: the cost of
    steps past the horizon is not computed. `scheduled`: the schedulers have just
    scheduled step 0 (`Instance._plan_step`): its blocks are allocated and its chunks
    registered, so the run starts with them done (None if step 0 would need more).
    `rest`: the steps a cut run had planned from here (`RunRest`), taken if they fit."""
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
    priced = None  # (timing, work) of the steps, when a cut run's rest gives them
    if rest is not None and rest.continues(pairs, step_index, now):
        tokens = RunTokens(rest.held, rest.new, None, len(rest.start), rest.finishes)
        priced = rest.timing, rest.work
    else:
        cum = accepted_before(step_index, max_steps, acceptance)
        tokens = plan_tokens(pairs, rank_of, step_index, cum, config, max_steps)
    if tokens is None or (tokens.prefill is not None
                          and not getattr(cost_model, "prices_chunk_rows", True)):
        return None
    k, finishes = tokens.steps, tokens.finishes
    held, new = tokens.held, tokens.new

    # Blocks each request must hold during step j: its slots are held + new tokens.
    have = np.array([s.kv.tables[r.request_id].n for s, r in pairs], dtype=np.int64)
    block_size = schedulers[0].kv.block_size
    need = np.where(new > 0, -(-(held[:, :k] + new) // block_size), 0)  # (n, k)
    blocks = np.maximum.accumulate(np.maximum(need, have[:, None]), axis=1)
    net = blocks - np.concatenate([have[:, None], blocks[:, :-1]], axis=1)  # (n, k)
    calls = net > 0
    if schedulers[0].kv.window is not None:
        slid = _window_slides(pairs, held[:, :k])
        if slid is None:
            return None  # a window page is shared: its release is not ours to plan
        pages = schedulers[0].kv.window.pages_per_block
        net, calls = net * (1 + pages) - slid * pages, calls | (slid > 0)
    if scheduled and calls[:, 0].any():
        return None  # step 0's KV work is not all done: not the step scheduled
    per_rank = rank_sums(net.T, rank_of, len(schedulers))  # (k, R)
    free = np.array([s.kv.pool.num_free for s in schedulers], dtype=np.int64)
    fits = (per_rank.cumsum(axis=0) <= free[None, :]).all(axis=1)
    if not fits.all():
        k, finishes = int(fits.argmin()), False
        if k < 1:
            return None

    prefill, chunk_end = None, 0  # the steps before chunk_end carry prefill chunks
    if tokens.prefill is not None:
        prefill = tokens.prefill[:, :k]
        busy = (prefill | (new[:, :k] == 0)).any(axis=0).nonzero()[0]
        chunk_end = max(int(busy[-1]) + 1 if len(busy) else 0, int(bool(tokens.lands)))

    # Cost of each step, then cut before the first step ending at or after the horizon.
    ranks = len(schedulers)
    if priced is not None:
        timing, work = _head(priced[0], k), priced[1].head(k)
    elif tokens.prefill is None:
        counts = np.bincount(rank_of, minlength=ranks).astype(np.int64)
        base = rank_sums(held[:, 0], rank_of, ranks)

        def rows(a: int, b: int) -> StepWork:
            return decode_work(counts, base, cum[a:b], width)
    else:
        whole = StepWork.from_entries(rank_of, ranks, held[:, :k], new[:, :k], prefill)
        rows = whole.rows
    if priced is None:
        timing, work = _step_timing(cost_model, lockstep, rows, k, now, horizon,
                                    step_guess_s, chunk_end)
    ends = np.concatenate([[now], timing.duration]).cumsum()[1:]
    within = int(ends.searchsorted(horizon, side="left"))  # steps ending < horizon
    start = np.concatenate([[now], ends[:-1]])
    within = min(within, int(start.searchsorted(landing, side="left")))
    if within < 1:
        return None
    used0 = np.array([s.kv.pool.num_used for s in schedulers], dtype=np.int64)
    kv_used = used0[None, :] + per_rank[:k].cumsum(axis=0)
    run = DecodeRun(start, timing, work, held[:, : k + 1], new[:, :k], prefill, pairs,
                    net[:, :k], calls[:, :k], kv_used, finishes, tokens.lands,
                    chunk_end, allocated=int(scheduled))
    run.truncate(within)
    return run


def _step_timing(cost_model, lockstep: bool, rows, k: int, now: float, horizon: float,
                 step_guess_s: float, head: int = 0):
    """The cost of the k steps whose StepWork `rows(a, b)` gives (steps [a, b)), or of
    a first part of them that ends at or after the horizon (what lies beyond is cut
    from the run anyway), and the StepWork of the steps costed. The part is sized from
    a recent step's duration; if it falls short of the horizon, the rest is costed too.
    The first `head` steps (those with prefill chunks) are costed on their own: the
    decode steps after them, alike, are then costed as one row (`LayerStepModel`'s
    memo). A step's cost depends on its own row of the work alone, so the parts are
    the rows of the whole."""
    first = k
    if step_guess_s > 0 and np.isfinite(horizon):
        first = max(1, min(k, int((horizon - now) / step_guess_s * 1.25) + 8))
    bounds = sorted({0, min(head, k), first, k})
    parts = []
    for a, b in zip(bounds, bounds[1:]):
        work = rows(a, b)
        parts.append(cost_model.step_timing(work, lockstep))
        durations = np.concatenate([p.duration for p in parts])
        # as plan_decode_run finds the steps' ends (same sums, same rounding)
        if b < k and np.concatenate([[now], durations]).cumsum()[-1] >= horizon:
            break
    if len(parts) == 1:
        return parts[0], work  # rows(0, b), built once
    timing = type(parts[0])(*(np.concatenate(f) for f in zip(*(_fields(p) for p in parts))))
    return timing, rows(0, b)


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
    zeros = np.zeros(ctx.shape, dtype=ctx.dtype)
    k = len(cum)
    return StepWork(
        prefill_tokens=zeros,
        decode_tokens=(counts * width)[None, :].repeat(k, axis=0),
        num_prefill_reqs=zeros,
        num_decode_reqs=counts[None, :].repeat(k, axis=0),
        kv_read_tokens=ctx + counts[None, :] * width,
        prefill_pairs=zeros,
        decode_pairs=width * ctx + counts[None, :] * (width * (width + 1) // 2),
        idle=(counts == 0)[None, :].repeat(k, axis=0),
        decode_context=ctx,
        same_counts=True,
    )


def _head(timing, k: int):
    """The first k steps of a StepTiming."""
    return type(timing)(*(a[:k] for a in _fields(timing)))


def _rows(timing, start: int):
    """The steps of a StepTiming from `start` on."""
    return type(timing)(*(a[start:] for a in _fields(timing)))
