"""Prefill chunks inside a fast-forwarded run: each request's tokens, step by step.

A prompt longer than one step's token budget (`max_num_batched_tokens`, less the
decodes) is computed over several steps, a chunk per step. While nobody waits, those
steps are as predictable as decode steps: the scheduler walks the running requests in
order, the decodes take `tokens_per_decode_step` each, and the prefill takes what is
left — min(pending, long_prefill_token_threshold, budget left) — except on a step off
the `prefill_schedule_interval` beat, which defers it (unless one token is left:
the scheduler runs that as it runs a decode). The step that computes the
prompt's last token emits its first token; from the next step on the request decodes
like the others. So a fast-forwarded run (`decode_run.py`) may carry such a request:
`plan_tokens` says, for every request of the run and every step, the tokens it holds
before the step and the tokens it computes in it; a request that finishes after the
prompt's last chunk may leave the run, as in a decode run (`decode_run.py`), one
that finishes before it ends the run (the chunks' sizes count the decodes beside them).

Only the common case is planned, where that is exactly what `Scheduler.schedule`
would do (`Scheduler.is_steady` admits no other): per rank at most one request in
prefill, the last in running order (so the decodes before it are never cut), its
prefix KV not on the wire (landed is fine: the run's first step takes it in, as the
scheduler does before its first chunk; so is landing at a later step, which then takes
it in, the request sitting the steps before out: `join`) and no other request's
either (a deferred chunk would then be listed elsewhere among the step's requests),
chunked prefill on, the rank not marked saturated (`prefill_capacity_bound`), and its
prompt not ending in its last output (a request that finishes with its first token
ends the run at once instead). A request recomputing its stream after a preemption is
planned up to the step that would leave it one token: the scheduler decodes that one
(`_decodes_from`).
Sliding windows, state snapshots, offload write-through and P/D prefill ranks are
left to single steps, and so is everything while someone listens to `StepStarted`
(a run's event names its requests, not the steps that compute their chunks, which
the request phases of the timeline and Gantt views draw); a cost model that cannot
price rows with chunks apart from the others declines them too (`plan_decode_run`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit


@dataclass(slots=True)
class RunTokens:
    """Per request of a run (rows, in the run's order) and step (columns)."""
    held: np.ndarray  # (n, k+1) tokens with KV before step j (after the last: column k)
    new: np.ndarray  # (n, k) tokens computed in step j (0: not scheduled, a deferred chunk)
    prefill: np.ndarray | None  # (n, k) bool: a prefill chunk; None: every entry decodes
    steps: int  # k, up to the first step that finishes a request
    finishes: bool  # step k - 1 finishes one
    lands: tuple = ()  # rows whose fetched prefix KV has landed: step land_step takes it in
    land_step: int = 0  # (0: it landed before the run; later: a row that joins the run)
    done: np.ndarray | None = None  # the steps each request is in before it leaves the
    # run, finished (None: none leaves before the end)


def plan_tokens(pairs, rank_of: list, step_index: int, cum: np.ndarray, config,
                max_steps: int, join: tuple[int, int] | None = None,
                leave: bool = False) -> RunTokens | None:
    """The tokens of up to max_steps steps (`cum`: tokens each decode accepts before
    step j); None if a rank's steps are not exactly this plan (see the docstring).
    `join`: (row, step) — that row's prefix KV is on the wire until the step, which
    takes it in and starts its chunks (it sits the steps before out). `leave`: a
    request that finishes (after the last prompt chunk, if any) leaves the run, the
    others decode on (`decode_run.py`); else the first to finish ends the run."""
    width = config.tokens_per_decode_step
    computed = np.array([r.num_computed_tokens for _, r in pairs], dtype=np.int64)
    remaining = np.array([r.remaining_output_tokens for _, r in pairs], dtype=np.int64)
    if join is None and all(r.is_decoding for _, r in pairs):
        # every request gains cum[j] by step j, up to its last token
        done = cum.searchsorted(remaining, side="left")  # steps to finish
        k, finishes, leaving = _run_end(done, max_steps, leave)
        held = computed[:, None] + np.minimum(cum[None, : k + 1], remaining[:, None])
        new = np.full((len(pairs), k), width, dtype=np.int64)
        return RunTokens(held, _sit_out(new, leaving), None, k, finishes, done=leaving)
    decoding = np.array([r.is_decoding for _, r in pairs], dtype=bool)
    held, new, prefill, done = _as_decodes(computed, remaining, cum, width)  # (then prompts)
    steps, lands, busy = max_steps, [], 0  # busy: the steps up to the last prompt chunk
    joining, land_step = join if join is not None else (-1, 0)
    for i in (~decoding).nonzero()[0].tolist():
        scheduler, req = pairs[i]
        rank_decodes = sum(1 for j, (s, _) in enumerate(pairs) if s is scheduler and j != i)
        at = land_step if i == joining else 0  # its first step in the run
        chunk = _chunks(scheduler, req, rank_decodes, step_index + at, config,
                        max_steps - at)
        if chunk is None:
            return None
        sizes, before, last, after = chunk
        if req.kv_ready_s:  # landed (or lands when it joins)
            lands.append(i)
        steps = min(steps, at + after, at + _decodes_from(req, before, last))
        busy = max(busy, at + last + 1)  # (step at + last ends its prompt)
        done[i] = _prompt_row(held[i], new[i], prefill[i], cum, at, sizes, before, last,
                              req.num_computed_tokens, req.num_pending_tokens,
                              int(remaining[i]))
    if joining >= 0:
        held[joining, :land_step] = computed[joining]  # sitting out, its prefix held
        if land_step >= min(steps, int(done.min())) or lands != [joining]:
            return None  # the run would end before it joins (or another row lands)
    k, finishes, leaving = _run_end(done, steps, leave, busy)
    return RunTokens(held[:, : k + 1], _sit_out(new[:, :k], leaving), prefill[:, :k], k,
                     finishes, tuple(lands), land_step if lands else 0, leaving)


def _decodes_from(req, before: np.ndarray, last: int) -> int:
    """The step (from the request's first in the run) where a request recomputing its
    stream after a preemption has one token left: the scheduler runs that step's entry
    as a decode (`Request.is_decoding`: it has output tokens), not as a one-token chunk,
    so the run must end before it (a chunk plan has no such row); past every step
    planned (`len(before)`) if none. A prompt not yet answered keeps its one-token last
    chunk a prefill chunk."""
    if req.num_output_tokens == 0:
        return len(before)
    one = (req.num_pending_tokens - before[: last + 1] == 1).nonzero()[0]
    return int(one[0]) if len(one) else len(before)


def _run_end(done: np.ndarray, steps: int, leave: bool, busy: int = 0):
    """(k, finishes, leaving) of a run whose request i finishes in its first done[i]
    steps: it ends at the first to finish — with `leave`, at the last, but for one
    finishing before step `busy` (its leaving would change the chunks of a prompt
    beside it) — or at `steps`; whether its last step finishes a request; `done` if
    one leaves before the end (None if not)."""
    each = done.tolist()  # (a few requests: Python's min and max are the cheaper)
    early = [d for d in each if d < busy] if leave else each
    last = min(early) if early else max(each)
    k, finishes = (last, True) if last <= steps else (steps, False)
    return k, finishes, (done if leave and min(each) < k else None)


def _sit_out(new: np.ndarray, done: np.ndarray | None) -> np.ndarray:
    """`new` with nothing computed by request i from step done[i] on (it has left)."""
    if done is not None:
        _zero_from(new, done)
    return new


@njit(cache=True)
def _zero_from(new, done) -> None:
    """new[i, done[i]:] = 0 for every row i."""
    for i in range(len(done)):
        new[i, done[i]:] = 0


@njit(cache=True)
def _as_decodes(computed, remaining, cum, width: int):
    """(held (n, k+1), new (n, k), prefill (n, k), done (n,)) of n requests decoding
    through k = len(cum) - 1 steps: request i holds computed[i] + cum[j] tokens before
    step j, up to its remaining[i] more, `width` new ones a step, no prefill, and
    finishes in its first done[i] steps (k + 1: not in these)."""
    n, k = len(computed), len(cum) - 1
    held = np.empty((n, k + 1), dtype=np.int64)
    for i in range(n):
        for j in range(k + 1):
            held[i, j] = computed[i] + min(cum[j], remaining[i])
    new = np.full((n, k), width, dtype=np.int64)
    return held, new, np.zeros((n, k), dtype=np.bool_), np.searchsorted(cum, remaining)


@njit(cache=True)
def _prompt_row(held, new, prefill, cum, at: int, sizes, before, last: int, computed: int,
                pending: int, remaining: int) -> int:
    """Fill one request's row (`held` (k+1,), `new` and `prefill` (k,), from step `at`,
    its first in the run, where it has `computed` tokens) with its prompt's chunks
    (`_chunks`: `sizes`, the tokens `before` each, the chunk `last` ending the prompt),
    then its decodes from a full prompt (the step after on, `cum[j]` accepted before
    step j, up to its `remaining` tokens, the first computed by its last chunk);
    return the steps to its finish (k + 1 where its prompt does not end in the run).
    It sits the steps before `at` out."""
    k = len(new)
    end = at + last  # the step ending its prompt
    new[:at] = 0
    for j in range(last + 1):
        held[at + j] = computed + before[j]
        if at + j < k:
            new[at + j] = sizes[j]
            prefill[at + j] = sizes[j] > 0
    if end >= k:
        return k + 1
    base, cap = cum[end + 1], remaining - 1
    finish = k - end  # steps after the prompt's until it has all (as searchsorted, left)
    for j in range(end + 1, k + 1):
        left = cum[j] - base
        held[j] = computed + pending + min(left, cap)
        if left >= cap and finish == k - end:
            finish = j - end - 1
    return end + 1 + finish


def _chunks(scheduler, req, rank_decodes: int, step_index: int, config, max_steps: int):
    """(chunk sizes of req's prefill per step (max_steps,), the tokens computed before
    each step (max_steps + 1,), the step that ends its prompt (max_steps if none does),
    the steps a run may take before its decodes would be cut by the budget), or None
    where the plan would not be exact."""
    width = config.tokens_per_decode_step
    budget = config.max_num_batched_tokens
    threshold = config.long_prefill_token_threshold
    left = budget - rank_decodes * width  # what the decodes before it leave
    share = min(left, threshold or left)
    pending = req.num_pending_tokens
    if share <= 0 or req.remaining_output_tokens <= 1:
        return None
    sizes, before, last = _chunk_sizes(step_index, max_steps,
                                       config.prefill_schedule_interval, rank_decodes > 0,
                                       share, pending)
    # decoding itself from then on: the budget must cover every decode of the rank
    after = max_steps if (rank_decodes + 1) * width <= budget else last + 1
    return sizes, before, last, after


@njit(cache=True)
def _chunk_sizes(step_index: int, max_steps: int, interval: int, others: bool, share: int,
                 pending: int):
    """(the chunk of each step, the tokens computed before each step, the step that
    computes the last pending token (max_steps if none)): `share` a step, except on the
    steps off the prefill_schedule_interval beat, which defer it when `others` decode —
    unless one token is left, which the scheduler runs as it runs a decode."""
    sizes = np.zeros(max_steps, dtype=np.int64)
    before = np.zeros(max_steps + 1, dtype=np.int64)
    last = max_steps
    for j in range(max_steps):
        if (step_index + j) % interval == 0 or not others or pending - before[j] <= 1:
            sizes[j] = min(share, pending - before[j])
        before[j + 1] = before[j] + sizes[j]
        if last == max_steps and before[j + 1] >= pending:
            last = j
    return sizes, before, last
