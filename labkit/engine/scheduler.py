"""The scheduler: which requests compute how many tokens in the next step.

One scheduler per DP rank, in the style of vLLM's v1 scheduler (continuous batching):

1. **Running requests first**, in order. Each asks for its pending tokens — a prefill
   chunk, or 1 + draft tokens when decoding — capped by the step's remaining token
   budget (`max_num_batched_tokens`) and by `long_prefill_token_threshold` (meant for
   long prefills; vLLM caps verify steps by it too). If the KV manager cannot grow its
   block table, the lowest-priority running request is **preempted** (its KV freed, to
   be recomputed) until it fits. A request that had to preempt *itself* ends the
   running pass: no one after it is scheduled in that step (as vLLM does; under the
   priority policy the requests after it may be more urgent, yet they wait too).
2. **Then waiting requests**, in policy order (FCFS, or priority then arrival), while
   budget, `max_num_seqs` and KV last. A request enters with its longest cached
   prefix already counted as computed — or, when a prefix source offers more of it
   (another rank's GPUs, the node's offload tiers: `transfer.py`), holds its blocks
   and waits for that copy. No new request is admitted in a step that preempted
   (that would only thrash).

**Same-step prefix hits.** The full blocks a prefill step will fill are registered in
the prefix cache when the step is planned, not when it ends (vLLM registers blocks
when it allocates them): a request admitted later in the same step with the same
prefix shares them, since a step writes every new token's KV before any attention
reads it. Only this rank's own lookups see such blocks before their step has run;
another rank fetching a prefix sees computed blocks only. (Decode steps register
their blocks when they end, once the accepted tokens are known; vLLM registers them
at the next allocation, one token later — no prompt can tell the difference.)

**`prefill_schedule_interval` N** (vLLM's DP prefill balancing, applied on every
instance as newer vLLM does without DP too): on a step whose index is not a multiple
of N (the index is shared by the ranks of a lockstep instance), a rank that has a
request able to decode *defers all prefill work*: running prefill chunks skip the
step and no waiting request with more than one token to compute is admitted; the
decodes run. Two guards keep it from hurting: a rank with nothing to decode is never
throttled (its step would be wasted), and when the last step that admitted prefills
could not drain the waiting queue (`prefill_capacity_bound`: the rank is saturated)
the throttle is lifted until a step drains it.

**Speculative decoding under a tight budget**: a decoding request cut by the budget
to fewer than 1 + drafts tokens verifies only the drafts it was given, so it never
gains more tokens than it was scheduled.

`schedule()` only plans; `update()` applies the outcome of the executed step.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from labkit.engine.events import (
    EventBus, FirstToken, RequestPreempted, RequestScheduled, RequestTokens, StepStarted,
)
from labkit.engine.kv.block_table import NO_MATCH, PrefixMatch
from labkit.engine.kv.kv_manager import KVManager
from labkit.engine.request import Request, Status
from labkit.engine.transfer import PrefixTransfer, best_transfer
from labkit.specs.config import EngineConfig


@dataclass(slots=True)
class RankBatch:
    """What one rank computes in one step."""

    rank: int
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    contexts: list[int] = field(default_factory=list)  # tokens with KV before the step
    is_decode: list[bool] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    def add(self, req: Request, n: int, decode: bool) -> None:
        self.requests.append(req)
        self.num_new_tokens.append(n)
        self.contexts.append(req.num_computed_tokens)
        self.is_decode.append(decode)

    def remove(self, req: Request) -> int:
        """Drop req's entry; returns the tokens it had been given."""
        i = self.requests.index(req)
        n = self.num_new_tokens[i]
        for column in (self.requests, self.num_new_tokens, self.contexts, self.is_decode):
            del column[i]
        return n

    def __len__(self) -> int:
        return len(self.requests)


class WaitingQueue:
    """FCFS (a deque; preempted requests go back to the front) or priority (a heap)."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []

    def __len__(self) -> int:
        return len(self._fifo) if self.policy == "fcfs" else len(self._heap)

    def push(self, req: Request, front: bool = False) -> None:
        if self.policy == "fcfs":
            self._fifo.appendleft(req) if front else self._fifo.append(req)
        else:
            heapq.heappush(self._heap, (req.priority, req.enqueued_s, req.seq, req))

    def peek(self) -> Request:
        return self._fifo[0] if self.policy == "fcfs" else self._heap[0][3]

    def pop(self) -> Request:
        return self._fifo.popleft() if self.policy == "fcfs" else heapq.heappop(self._heap)[3]

    def __iter__(self):
        if self.policy == "fcfs":
            return iter(self._fifo)
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVManager, events: EventBus,
                 rank: int = 0, prefix_sources=(), hold_kv_on_finish: bool = False) -> None:
        """`prefix_sources`: where else a prefix may come from (`transfer.py`), each
        `offer(req, cached, now)`; `hold_kv_on_finish`: keep a finished request's blocks
        (a P/D prefill's KV waits to be sent, `disagg.py`)."""
        self.config = config
        self.kv = kv
        self.events = events
        self.rank = rank
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.running: list[Request] = []
        self.now = 0.0
        self.prefix_sources = tuple(prefix_sources)
        self.hold_kv_on_finish = hold_kv_on_finish
        # the last step that admitted prefills left some waiting: don't throttle
        self.prefill_capacity_bound = False
        # async scheduling: requests that arrived after this time are not yet visible
        # (the instance sets it before each step, as it sets `now`)
        self.visible_until = float("inf")
        self._landed_by = 0.0  # KV that landed by then is seen (`on_the_wire`)

    # ----------------------------------------------------------------- state
    def add_request(self, req: Request) -> None:
        req.status = Status.WAITING
        req.rank = self.rank
        self.waiting.push(req)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def is_steady(self) -> bool:
        """Every running request decodes (or waits for its prefix KV on the wire, which
        the steps skip until it lands: `on_the_wire`) — or, the last one, continues its
        prompt's chunked prefill (`chunk_run.py`) — all fit in the budget, nobody waits:
        the next steps are as predictable as a run needs until something finishes."""
        if len(self.waiting) or not self.running:
            return False
        cfg = self.config
        per_req = cfg.tokens_per_decode_step
        if per_req * len(self.running) > cfg.max_num_batched_tokens or \
                0 < cfg.long_prefill_token_threshold < per_req:
            return False
        decoding = 0
        last = self.running[-1]
        for r in self.running:
            if r.kv_ready_s > self.now:
                continue
            # (KV that has landed is taken in by a single step: it registers the copied
            # blocks in the prefix cache, in running order; a P/D hand-over lands
            # decoding; a run takes in only the last request's, before its first chunk)
            if r.pending_copies or (r.kv_ready_s and (r is not last or r.is_decoding)):
                return False
            if r.is_decoding:
                decoding += 1
            elif r is not last or not self._runs_chunks():
                return False
        return decoding > 0 or not (last.is_decoding or self.on_the_wire(last))

    def _runs_chunks(self, joining: Request | None = None) -> bool:
        """May a run carry the last running request's prefill chunks (`chunk_run.py`)?
        Not with KV on the wire (but `joining`'s, which joins the run as it lands),
        nor where the chunks' KV work is more than blocks (sliding-window pages, state
        snapshots, offload write-through), nor on a P/D prefill rank, nor while the
        rank counts as saturated, nor while someone listens to StepStarted (it tells a
        run's requests, not which steps compute their chunks: the request phases of
        `exporters/request_phases.py` read chunks off single steps)."""
        kv = self.kv
        return (self.config.enable_chunked_prefill and not self.prefill_capacity_bound
                and not self.events.wants(StepStarted)
                and not self.hold_kv_on_finish and kv.window is None
                and kv.snapshots is None and kv.on_cached is None
                and not any(self.on_the_wire(r) for r in self.running if r is not joining))

    def may_join_run(self, req: Request) -> bool:
        """Once req's prefix KV has landed, may a run that went on while it was on the
        wire go on with it (`run_plan._join_landing`)? Where the step that takes the KV
        in would find this rank steady, with req's prompt chunks to run
        (`is_steady`): req is the last running request, the only one on the wire, not
        a P/D hand-over (seen a step late, landing decoding), and a run may carry its
        chunks — and nobody reads the per-step token rows, which list a request on the
        wire apart (`Instance._run_tokens`)."""
        return (bool(self.running) and self.running[-1] is req and not req.async_kv_load
                and not req.is_decoding and not req.pending_copies
                and not self.events.wants(RequestTokens) and self._runs_chunks(joining=req))

    def on_the_wire(self, req: Request) -> bool:
        """Is req's prefix KV still being copied here, as this step sees it (the steps skip
        it until then)? A P/D hand-over's landing is seen like an arrival (`async_kv_load`:
        vLLM's worker reports it at a step's end, read after the next step is scheduled),
        unless the rank had nothing else to run (an idle engine polls at once)."""
        return req.kv_ready_s > (self._landed_by if req.async_kv_load else self.now)

    # -------------------------------------------------------------- schedule
    def schedule(self, step_index: int, throttle_prefills: bool | None = None) -> RankBatch:
        """Plan one step. `throttle_prefills`: the step is off the
        prefill_schedule_interval beat (default: judged from `step_index`)."""
        if throttle_prefills is None:
            throttle_prefills = step_index % self.config.prefill_schedule_interval != 0
        # vLLM's guards: throttle only to protect a decode, never a saturated rank
        defer = throttle_prefills and not self.prefill_capacity_bound and any(
            not _computes_prefill(r) for r in self.running)
        batch = RankBatch(self.rank)
        busy = any(not r.kv_ready_s for r in self.running)  # ran a step before this one
        self._landed_by = self.visible_until if busy else self.now
        budget = self._schedule_running(batch, self.config.max_num_batched_tokens, defer)
        # No preemption from here on: the blocks the prefill chunks fill can be hit.
        for req, n, decode in zip(batch.requests, batch.num_new_tokens, batch.is_decode):
            if not decode:
                self.kv.register_blocks(req, req.num_computed_tokens + n)
        if batch.preempted:
            return batch
        self._admit_waiting(batch, budget, defer)
        if not defer:
            self.prefill_capacity_bound = self._waiting_visible()
        return batch

    def _waiting_visible(self) -> bool:
        """Is a request this step could see still waiting? (vLLM's capacity-bound guard
        looks at the queue its scheduler saw; under async scheduling a request that arrived
        after the step was scheduled is not in it, so it must not read as saturation.)"""
        return any(r.enqueued_s <= self.visible_until for r in self.waiting)

    def _schedule_running(self, batch: RankBatch, budget: int, defer: bool) -> int:
        """Running requests in order, preempting for KV as needed; returns the budget
        left."""
        cfg, kv, running = self.config, self.kv, self.running
        threshold = cfg.long_prefill_token_threshold
        per_decode = cfg.tokens_per_decode_step
        # (a saturated step runs hundreds of requests: the common case below is written
        # out -- `Request.is_decoding`, `RankBatch.add` -- and the names looked up once)
        has_room, end = kv.has_room, len(running)
        requests, counts, contexts, decodes = (batch.requests, batch.num_new_tokens,
                                               batch.contexts, batch.is_decode)
        i = 0
        while i < end and budget > 0:
            req = running[i]
            if req.kv_ready_s:  # its prefix KV is (or was) being copied in
                if self.on_the_wire(req):  # still on the wire
                    i += 1
                    continue
                req.kv_ready_s = 0.0
                kv.cache_full_blocks(req, starting=True)  # the copied prefix arrived
            if defer and _computes_prefill(req):
                i += 1
                continue
            pending = req.num_prompt_tokens + req.num_output_tokens - req.num_computed_tokens
            decode = pending == 1 and req.num_output_tokens > 0
            n = per_decode if decode else pending
            if 0 < threshold < n:  # vLLM caps verify steps by it too
                n = threshold
            if budget < n:
                n = budget
            if not has_room(req, n):  # (most steps of a decode have)
                while not kv.allocate(req, n):
                    victim = self._pick_victim()
                    if victim is not req and victim in batch.requests:
                        budget += batch.remove(victim)  # un-schedule it (priority policy)
                        i -= 1
                    self._preempt(victim, batch)
                    if victim is req:
                        break
                if req.status is not Status.RUNNING:
                    break  # it preempted itself: nothing more runs this step (vLLM)
                end = len(running)  # (less any it preempted)
            requests.append(req)
            counts.append(n)
            contexts.append(req.num_computed_tokens)
            decodes.append(decode)
            budget -= n
            i += 1
        return budget

    def _admit_waiting(self, batch: RankBatch, budget: int, defer: bool) -> None:
        """Waiting requests in policy order while budget, max_num_seqs and KV last."""
        cfg = self.config
        threshold = cfg.long_prefill_token_threshold
        while len(self.waiting) and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting.peek()
            if req.enqueued_s > self.visible_until:
                break  # arrived after this step was scheduled (async scheduling)
            adopted = req.request_id in self.kv.tables  # forked from a running parent
            match = NO_MATCH if adopted else self._cached_prefix(req)
            cached = req.num_computed_tokens if adopted else match.num_tokens
            pending = req.num_tokens - cached
            transfer = self._transfer(req, cached, adopted)
            if transfer is not None:  # hold the blocks now, compute once the KV has arrived
                if not self.kv.allocate(req, transfer.tokens - cached, match, copied=True):
                    break
                before, req.num_computed_tokens = req.num_computed_tokens, transfer.tokens
                seconds = transfer.admit(req, self.now)
                if seconds is None:  # the copy cannot be made after all (a damaged tier
                    req.num_computed_tokens = before  # block, now forgotten): release
                    self.kv.free(req)  # the blocks and ask the sources again
                    continue
                self.waiting.pop()
                req.kv_ready_s = self.now + seconds
                self._start(req)
                continue
            if defer and pending > 1:
                break  # a throttled step: its prefill waits for the beat
            # vLLM caps a prompt by the threshold even without chunked prefill, which only
            # refuses to take less than that share
            n = min(pending, threshold or pending)
            if n > budget and not cfg.enable_chunked_prefill:
                break
            n = min(n, budget)
            if not self.kv.allocate(req, n, match):
                break
            self.waiting.pop()
            req.num_computed_tokens = cached
            self._start(req)
            self.kv.register_blocks(req, cached + n)
            batch.add(req, n, False)
            budget -= n

    def _transfer(self, req: Request, cached: int, adopted: bool) -> PrefixTransfer | None:
        """The best offer to copy more of req's prefix than this rank caches (see
        `transfer.py`); only at a request's first admission."""
        if adopted or not self.prefix_sources or req.num_cached_tokens >= 0:
            return None
        offer = best_transfer(source(req, cached, self.now) for source in self.prefix_sources)
        return offer if offer is not None and offer.tokens > cached else None

    def next_ready_s(self) -> float | None:
        """When the first request still fetching KV can run (None if none is)."""
        times = [r.kv_ready_s for r in self.running if self.on_the_wire(r)]
        # (landed, unseen as a busy rank sees it: now, for a rank left with nothing to run)
        return max(min(times), self.now) if times else None

    def _cached_prefix(self, req: Request) -> PrefixMatch:
        return self.kv.lookup(req) if self.config.enable_prefix_caching else NO_MATCH

    def _start(self, req: Request) -> None:
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = req.num_computed_tokens
            req.first_scheduled_s = self.now
        req.status = Status.RUNNING
        self.running.append(req)
        if self.events.wants(RequestScheduled):
            self.events.emit(RequestScheduled(self.now, req.request_id, self.rank,
                                              req.num_computed_tokens, req.num_prompt_tokens))

    def _pick_victim(self) -> Request:
        if self.config.scheduling_policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.enqueued_s, r.seq))
        return self.running[-1]

    def _preempt(self, req: Request, batch: RankBatch) -> None:
        self.running.remove(req)
        if self.events.wants(RequestPreempted):
            self.events.emit(RequestPreempted(self.now, req.request_id, self.rank,
                                              req.num_computed_tokens))
        req.prefix_hint = self.kv.free(req)
        req.num_computed_tokens = 0
        req.pending_copies.clear()
        req.num_preemptions += 1
        req.status = Status.PREEMPTED
        self.waiting.push(req, front=True)
        batch.preempted.append(req)

    # ---------------------------------------------------------------- update
    def update(self, batch: RankBatch, accepted: int, t_end: float,
               tokens: dict | None = None) -> list[Request]:
        """Apply an executed step. Simulated: decode entries accept `accepted` tokens
        each — at most the tokens they were scheduled (a budget cut leaves fewer drafts
        to verify). Computed: `tokens` maps a request to the token ids it produced (a
        decode entry's verified tokens; one sampled token for a prompt's last chunk).
        Capped by what a request may still generate. Returns the finished requests."""
        finished, stepped = [], []
        batched = not self.events.wants(FirstToken)  # (nobody looks at the KV mid-update)
        # the blocks they filled: registered at the end, as one (or call by call)
        cache_full_blocks = stepped.append if batched else self.kv.cache_full_blocks
        produced = None  # (simulated: no token ids)
        size = self.kv.block_size
        for req, n, decode in zip(batch.requests, batch.num_new_tokens, batch.is_decode):
            if req.pending_copies:
                req.pending_copies.clear()
            if tokens is not None:
                produced = tokens.get(req.request_id)
            if decode:
                a = min(accepted if produced is None else len(produced), n,
                        req.max_output_tokens - req.num_output_tokens)
                # A decode that fills no block has none newly full (most steps of a
                # decode: hundreds of them in a saturated step): the blocks filled before
                # it were registered by whatever filled them -- an earlier step, the
                # admission's prefix hit, the landing of a copied prefix, a run.
                # (Computed tokens extend the keys: their blocks are asked each time.)
                fills = req.num_computed_tokens % size + a >= size or tokens is not None
                req.num_computed_tokens += a
                if produced is not None:
                    self._record(req, produced, a)
                req.emit(a, t_end)
            else:
                fills = True
                if req.num_computed_tokens < req.num_prompt_tokens:
                    req.num_computed_prefill_tokens += min(
                        n, req.num_prompt_tokens - req.num_computed_tokens)
                req.num_computed_tokens += n
                if req.num_computed_tokens == req.num_tokens:
                    self._record(req, produced, 1)
                    if req.emit(1, t_end) and self.events.wants(FirstToken):
                        self.events.emit(FirstToken(t_end, req.request_id, self.rank))
            if fills:
                cache_full_blocks(req)
            if req.num_output_tokens >= req.max_output_tokens:  # nothing left to generate
                finished.append(req)
        if batched:
            self.kv.cache_full_blocks_of(stepped)
        for req in finished:
            self.finish(req, t_end)
        return finished

    @staticmethod
    def _record(req: Request, produced, count: int) -> None:
        """Keep real token ids (compute plane); their blocks get keys from them."""
        if produced is None:
            return
        new = list(produced[:count])
        req.output_token_ids.extend(new)
        if hasattr(req.keys, "extend"):
            req.keys.extend(new)

    def finish(self, req: Request, t: float) -> None:
        self.running.remove(req)
        req.status = Status.FINISHED
        req.finish_s = t
        if self.hold_kv_on_finish:  # a P/D prefill: its KV waits to be sent (disagg.py)
            req.prefix_hint = None
            return
        req.prefix_hint = self.kv.free(req)


def _computes_prefill(req: Request) -> bool:
    """Has req more than one token to compute (a prefill chunk's worth of work, or KV
    still on its way)? What `prefill_schedule_interval` defers; the rest decodes."""
    return req.num_pending_tokens > 1 or req.kv_ready_s > 0.0
