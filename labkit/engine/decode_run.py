"""Fast-forward: simulate a run of steady decode steps in one go.

Most steps of an agentic replay are alike: every running request decodes, nobody
waits, nothing is admitted. Until a request finishes or a new one arrives, each such
step has the same shape; only the contexts grow by the tokens accepted. Simulating
them one by one costs Python work per request per step; a `DecodeRun` holds k of them
planned at once with numpy (`run_plan.py`):

- accepted tokens per step follow the instance's deterministic acceptance counter,
  the same for every request in a step, so after j steps each request has gained
  ``cum[j]`` tokens;
- the steps' costs are one vectorised call of the cost model on (k, ranks) arrays;
- the block allocations the steps need are found arithmetically (where each
  request's slot count crosses a block boundary), and so are, for sliding-window
  layers, the pages freed as the window passes a block boundary.

A run is then *played back* lazily, exactly as step-by-step simulation would have
done it: the allocations of step j happen when step j starts, its tokens are emitted
(and full blocks cached) when it ends. An arrival that joins the instance cuts the
run after the step in progress (`Instance.sync`), so the newcomer is scheduled in
the next step just as it would have been; whatever reads the engine's KV in the
middle of a run (another rank fetching from it, a router reading progress) first
plays it up to then. The run stops where the pool would run out of blocks.

A request that finishes **leaves** the run (`stops`): the instance commits the run up
to that step, frees the request's KV and reports it finished, and the others decode
on — the steps a run planned after the finish would have planned (decodes alone, or
decodes after the last prompt chunk: the chunks' sizes depend on the decodes beside
them; the ranks' counts change, and are priced so). The blocks the finished request
freed come off the later steps' KV use as the commit finds them. Lockstep ranks do
not leave (each leaving a new shape of step to price, mostly for nothing: an arrival
cuts most runs first), nor does anyone while events name a run's requests
(`Instance._may_leave`). A rank's KV work in a playback is done in one batch where
that is exact (`kv/batch_play.py`). A fast-forwarded replay is
identical to a step-by-step one, bit for bit; `tests/engine/test_fast_forward.py`
checks exactly that.

A run may also carry a long prompt's **prefill chunks** (`chunk_run.py`): per rank one
request still computing its prompt, chunk by chunk, until the step that ends it emits
its first token; then it decodes with the others (one whose prefix KV lands in the
middle of the run joins it there, `land_step`, sitting the steps before out). Its
entries are held, like every request's, as (request, step) arrays of tokens — those
with KV before each step and those computed in it — from which the allocations, the
cost model's rows and the playback follow; its chunks' blocks are registered when
their step starts, as `Scheduler.schedule` registers them (a rank's batch registers
them with the blocks filled: `kv/batch_play.py`).

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

from labkit.engine.events import FirstToken
from labkit.engine.kv.batch_play import play_run_in_batches
from labkit.engine.step_work import StepWork


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
    lands: tuple = ()  # rows whose landed prefix KV step land_step takes in (`chunk_run.py`)
    chunk_end: int = 0  # the steps before it carry prefill chunks (or sit one out)
    allocated: int = 0  # steps whose allocations are done
    committed: int = 0  # steps whose outputs are applied
    land_step: int = 0  # (a row that joins the run when its prefix KV lands: then)
    stops: tuple = ()  # a run of decodes: after these many steps some requests leave it

    @property
    def steps(self) -> int:
        return len(self.start)

    @property
    def next_stop(self) -> int:
        """The steps up to the next that finishes a request (all of them if none does)."""
        return self.stops[0] if self.stops else self.steps  # (those passed are dropped)

    @property
    def commit_end(self) -> float:
        """When the next step that finishes a request (or the last step) ends: the
        instance commits the run up to there, and goes on with the others."""
        last = self.next_stop - 1
        return float(self.start[last] + self.timing.duration[last])

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
            at = self.land_step
            if self.allocated <= at < alloc_stop:
                events += [(at, 1, i, 0, at) for i in self.lands if i in rows]
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
                    kv.cache_full_blocks(req, starting=True)
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
        gaps = times[1:] - times[:-1]  # every request's, held by reference (`TokenGaps`)
        gaps.flags.writeable = False
        first_end, last_end = float(times[0]), float(times[-1])
        gained = (self.held[:, stop] - self.held[:, first]).tolist()
        chunked = () if self.prefill is None else (  # not decoding throughout
            self.prefill[:, first:stop] | (self.new[:, first:stop] == 0)).any(axis=1)
        finished = []
        for i, ((scheduler, req), n) in enumerate(zip(self.pairs, gained)):
            if len(chunked) and chunked[i]:
                self._emit_chunked(i, first, stop, ends, gaps)
            else:
                _emit_decodes(req, first_end, gaps, n, last_end)
            if req.remaining_output_tokens <= 0:
                finished.append((scheduler, req))
        self.committed = stop
        return finished

    def _emit_chunked(self, i: int, first: int, stop: int, ends, gaps) -> None:
        """Steps [first, stop) of a request that computes prefill chunks in some (or sits
        some out): what `Scheduler.update` does, step by step (the prompt's last chunk
        emits the first token) — and, for the decodes after them, what it does in all
        of them at once (`gaps`: the steps' gaps, as `_emit_tokens` has them)."""
        scheduler, req = self.pairs[i]
        busy = (self.prefill[i, first:stop] | (self.new[i, first:stop] == 0)).nonzero()[0]
        tail = first + int(busy[-1]) + 1  # it decodes in every step from here on
        for j in (self.new[i, first:tail].nonzero()[0] + first).tolist():
            n, t = int(self.new[i, j]), float(ends[j])
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
        if tail < stop:  # (its first token came with its prompt's last chunk)
            _emit_decodes(req, float(ends[tail]), gaps[tail - first:],
                          int(self.held[i, stop] - self.held[i, tail]), float(ends[stop - 1]))

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
        if steps >= self.steps or (self.prefill is not None and steps < self.chunk_end):
            return None  # (a prompt's chunks are planned in it)
        held, new = self.held[:, steps:], self.new[:, steps:]
        requests = [r for _, r in self.pairs]
        if self.stops and self.stops[0] <= steps:  # keep those that have not left by then
            rows = (new[:, 0] > 0).nonzero()[0]
            held, new, requests = held[rows], new[rows], [requests[i] for i in rows.tolist()]
        return RunRest(step_index, self.start[steps:], self.timing.rows(steps),
                       self.work.rows(steps, self.steps), held, new, requests, self.finishes)

    def truncate(self, steps: int) -> None:
        """Keep only the first `steps` steps (the rest will be planned again)."""
        if steps >= self.steps:  # (the steps planned past those priced, if any, go)
            self.stops = tuple(s for s in self.stops if s < self.steps)
            return
        self.start = self.start[:steps]
        self.timing = self.timing.head(steps)
        self.work = self.work.head(steps)
        self.kv_used = self.kv_used[:steps]
        self.new_blocks = self.new_blocks[:, :steps]
        self.kv_calls = self.kv_calls[:, :steps]
        self.held = self.held[:, : steps + 1]
        self.new = self.new[:, :steps]
        if self.prefill is not None:
            self.prefill = self.prefill[:, :steps]
        self.chunk_end = min(self.chunk_end, steps)
        if steps <= self.land_step:
            self.lands = ()  # its KV lands after the steps kept
        self.finishes = steps in self.stops
        self.stops = tuple(s for s in self.stops if s < steps)

    def drop_finished(self) -> None:
        """Forget the requests that finished (committed): the run goes on without them."""
        keep = [i for i, (_, r) in enumerate(self.pairs) if r.remaining_output_tokens > 0]
        self.pairs = [self.pairs[i] for i in keep]
        self.held, self.new = self.held[keep], self.new[keep]
        self.new_blocks, self.kv_calls = self.new_blocks[keep], self.kv_calls[keep]
        if self.prefill is not None:
            self.prefill = self.prefill[keep]
        self.lands = tuple(keep.index(i) for i in self.lands if i in keep)
        self.stops = tuple(s for s in self.stops if s > self.committed)


def _emit_decodes(req, first_end: float, gaps, gained: int, last_end: float) -> None:
    """req decoded in consecutive steps, the first ending at first_end, then `gaps`
    apart, the last at last_end: `gained` tokens, one ITL per step."""
    req.itl.append(first_end - req.last_token_s)
    req.itl.extend(gaps)
    req.num_output_tokens += gained
    req.num_computed_tokens += gained
    req.last_token_s = last_end


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
