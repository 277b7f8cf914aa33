"""Prefill chunks inside a fast-forwarded run: each request's tokens, step by step.

A prompt longer than one step's token budget (`max_num_batched_tokens`, less the
decodes) is computed over several steps, a chunk per step. While nobody waits, those
steps are as predictable as decode steps: the scheduler walks the running requests in
order, the decodes take `tokens_per_decode_step` each, and the prefill takes what is
left — min(pending, long_prefill_token_threshold, budget left) — except on a step off
the `prefill_schedule_interval` beat, which defers it. The step that computes the
prompt's last token emits its first token; from the next step on the request decodes
like the others. So a fast-forwarded run (`decode_run.py`) may carry such a request:
`plan_tokens` says, for every request of the run and every step, the tokens it holds
before the step and the tokens it computes in it, the run ending at the first step
that finishes a request, as a decode run does.

Only the common case is planned, where that is exactly what `Scheduler.schedule`
would do (`Scheduler.is_steady` admits no other): per rank at most one request in
prefill, the last in running order (so the decodes before it are never cut), its
prefix KV not on the wire (landed is fine: the run's first step takes it in, as the
scheduler does before its first chunk; so is landing at a later step, which then takes
it in, the request sitting the steps before out: `join`) and no other request's
either (a deferred chunk would then be listed elsewhere among the step's requests),
chunked prefill on, the rank not marked saturated (`prefill_capacity_bound`), and its
prompt not ending in its last output (a request that finishes with its first token
ends the run at once instead).
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


def plan_tokens(pairs, rank_of: list, step_index: int, cum: np.ndarray, config,
                max_steps: int, join: tuple[int, int] | None = None) -> RunTokens | None:
    """The tokens of up to max_steps steps (`cum`: tokens each decode accepts before
    step j); None if a rank's steps are not exactly this plan (see the docstring).
    `join`: (row, step) — that row's prefix KV is on the wire until the step, which
    takes it in and starts its chunks (it sits the steps before out)."""
    width = config.tokens_per_decode_step
    computed = np.array([r.num_computed_tokens for _, r in pairs], dtype=np.int64)
    remaining = np.array([r.remaining_output_tokens for _, r in pairs], dtype=np.int64)
    if join is None and all(r.is_decoding for _, r in pairs):
        # every request gains cum[j] by step j; the first to finish ends the run
        first_done = int(cum.searchsorted(remaining.min(), side="left"))
        k, finishes = (first_done, True) if first_done <= max_steps else (max_steps, False)
        held = computed[:, None] + np.minimum(cum[None, : k + 1], remaining[:, None])
        return RunTokens(held, np.full((len(pairs), k), width, dtype=np.int64), None, k,
                         finishes)
    decoding = np.array([r.is_decoding for _, r in pairs], dtype=bool)
    held = computed[:, None] + np.minimum(cum[None, :], remaining[:, None])
    new = np.full((len(pairs), max_steps), width, dtype=np.int64)
    prefill = np.zeros((len(pairs), max_steps), dtype=bool)
    done = cum.searchsorted(remaining, side="left")  # steps to finish, decoding
    steps, lands = max_steps, []
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
        steps = min(steps, at + after)
        pending, end = req.num_pending_tokens, at + last  # end: the step ending its prompt
        new[i, :at] = 0
        held[i, at : end + 1] = req.num_computed_tokens + before[: last + 1]
        new[i, at : end + 1] = sizes[: last + 1]
        prefill[i, at : end + 1] = sizes[: last + 1] > 0
        if end < max_steps:  # a decode from step end + 1 on, from a full prompt
            left = cum[end + 1:] - cum[end + 1]
            held[i, end + 1:] = req.num_computed_tokens + pending + \
                np.minimum(left, remaining[i] - 1)
            done[i] = end + 1 + int(np.searchsorted(left, remaining[i] - 1, side="left"))
        else:
            done[i] = max_steps + 1
    if joining >= 0:
        held[joining, :land_step] = computed[joining]  # sitting out, its prefix held
        if land_step >= min(steps, int(done.min())) or lands != [joining]:
            return None  # the run would end before it joins (or another row lands)
    first_done = int(done.min())
    k, finishes = (first_done, True) if first_done <= steps else (steps, False)
    return RunTokens(held[:, : k + 1], new[:, :k], prefill[:, :k], k, finishes, tuple(lands),
                     land_step if lands else 0)


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
    steps off the prefill_schedule_interval beat, which defer it when `others` decode."""
    sizes = np.zeros(max_steps, dtype=np.int64)
    before = np.zeros(max_steps + 1, dtype=np.int64)
    last = max_steps
    for j in range(max_steps):
        if (step_index + j) % interval == 0 or not others:
            sizes[j] = min(share, pending - before[j])
        before[j + 1] = before[j] + sizes[j]
        if last == max_steps and before[j + 1] >= pending:
            last = j
    return sizes, before, last
