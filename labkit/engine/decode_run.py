"""Fast-forward: simulate a run of steady decode steps in one go.

Most steps of an agentic replay are alike: every running request decodes, nobody
waits, nothing is admitted. Until a request finishes or a new one arrives, each such
step has the same shape; only the contexts grow by the tokens accepted. Simulating
them one by one costs Python work per request per step; a `DecodeRun` computes k of
them at once with numpy:

- accepted tokens per step follow the instance's deterministic acceptance counter,
  the same for every request in a step, so after j steps each request has gained
  ``cum[j]`` tokens;
- the steps' costs are one vectorised call of the cost model on (k, ranks) arrays;
- the block allocations the steps need are found arithmetically (where each
  request's slot count crosses a block boundary) and applied in exactly the order a
  step-by-step simulation would apply them.

The run stops at the first step that finishes a request, before the first step that
would end at or after the horizon (the next arrival, or the earliest time another
instance could finish something), and when the pool could not supply the blocks. A
fast-forwarded replay is therefore identical to a step-by-step one, bit for bit;
`tests/engine/test_fast_forward.py` checks exactly that.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from labkit.engine.sim.work import StepWork


@dataclass(slots=True)
class DecodeRun:
    steps: int
    start: np.ndarray  # (k,) step start times
    timing: object  # StepTiming over (k, R)
    work: StepWork
    cum: np.ndarray  # (k+1,) tokens accepted before step j, per request
    requests: list  # per rank, the running requests
    kv_used: np.ndarray  # (k, R) blocks in use during each step
    finishes: bool

    @property
    def end(self) -> float:
        return float(self.start[-1] + self.timing.duration[-1])


def accepted_before(step_index: int, steps: int, acceptance) -> np.ndarray:
    """cum[j] = tokens accepted in steps step_index .. step_index + j - 1 (A(x)=floor(x p/q))."""
    p, q = acceptance.numerator, acceptance.denominator
    x = np.arange(step_index, step_index + steps + 1, dtype=np.int64)
    total = (x * p) // q
    return total - total[0]


def plan_decode_run(schedulers, step_index: int, acceptance, config, cost_model,
                    lockstep: bool, now: float, horizon: float,
                    max_steps: int) -> DecodeRun | None:
    """Plan (and allocate for) up to max_steps steady decode steps, or None."""
    requests = [list(s.running) for s in schedulers]
    flat = [r for reqs in requests for r in reqs]
    if not flat:
        return None
    kvs = [s.kv for s in schedulers]
    rank_of = np.repeat(np.arange(len(requests)), [len(reqs) for reqs in requests])
    if any(kvs[r].tail_is_shared(req) for r, req in zip(rank_of.tolist(), flat)):
        return None  # a copy-on-write is due: let a normal step do it
    width = config.tokens_per_decode_step
    cum = accepted_before(step_index, max_steps, acceptance)

    # The first request to finish ends in the step after which cum reaches its remainder.
    remaining = min(r.remaining_output_tokens for r in flat)
    first_done = int(np.searchsorted(cum, remaining, side="left"))
    k, finishes = (first_done, True) if first_done <= max_steps else (max_steps, False)

    # Blocks each request must hold during step j: its slots are computed + width.
    block_size = kvs[0].block_size
    computed = np.array([r.num_computed_tokens for r in flat], dtype=np.int64)
    have = np.array([kvs[r].tables[req.request_id].n for r, req in zip(rank_of.tolist(), flat)],
                    dtype=np.int64)
    need = -(-(computed[:, None] + cum[None, :k] + width) // block_size)  # (n, k)
    held = np.maximum.accumulate(np.maximum(need, have[:, None]), axis=1)
    new = np.diff(np.concatenate([have[:, None], held], axis=1), axis=1)  # (n, k)
    per_rank_new = np.zeros((k, len(requests)), dtype=np.int64)
    np.add.at(per_rank_new, (slice(None), rank_of), new.T)
    free = np.array([kv.pool.num_free for kv in kvs], dtype=np.int64)
    fits = (np.cumsum(per_rank_new, axis=0) <= free[None, :]).all(axis=1)
    if not fits.all():
        k, finishes = int(np.argmin(fits)), False
        if k < 1:
            return None

    # Cost of each step, then cut before the first step ending at or after the horizon.
    counts = np.array([len(reqs) for reqs in requests], dtype=np.int64)
    base = np.array([sum(r.num_computed_tokens for r in reqs) for reqs in requests],
                    dtype=np.int64)
    work = decode_work(counts, base, cum[:k], width)
    timing = cost_model.step_timing(work, lockstep)
    ends = np.cumsum(np.concatenate([[now], timing.duration]))[1:]
    within = int(np.searchsorted(ends, horizon, side="left"))  # steps ending < horizon
    if within < k:
        k, finishes = within, False
        if k < 1:
            return None
        work, timing = _head(work, k), _head(timing, k)
    start = np.concatenate([[now], ends[: k - 1]])

    used0 = np.array([kv.pool.num_used for kv in kvs], dtype=np.int64)
    kv_used = used0[None, :] + np.cumsum(per_rank_new[:k], axis=0)
    run = DecodeRun(k, start, timing, work, cum[: k + 1], requests, kv_used, finishes)
    _allocate(run, flat, new[:, :k], rank_of, kvs, width)
    return run


def decode_work(counts: np.ndarray, base: np.ndarray, cum: np.ndarray, width: int) -> StepWork:
    """StepWork of k decode steps for ranks with `counts` requests of summed context `base`."""
    ctx = base[None, :] + counts[None, :] * cum[:, None]  # (k, R) summed contexts
    zeros = np.zeros_like(ctx)
    return StepWork(
        prefill_tokens=zeros,
        decode_tokens=np.broadcast_to(counts * width, ctx.shape).copy(),
        num_prefill_reqs=zeros,
        num_decode_reqs=np.broadcast_to(counts, ctx.shape).copy(),
        kv_read_tokens=ctx + counts[None, :] * width,
        prefill_pairs=zeros,
        decode_pairs=width * ctx + counts[None, :] * (width * (width + 1) // 2),
        idle=np.broadcast_to(counts == 0, ctx.shape).copy(),
    )


def _head(obj, k: int):
    """The first k steps of a StepWork or StepTiming."""
    return type(obj)(*(getattr(obj, f)[:k] for f in type(obj).__slots__))


def _allocate(run: DecodeRun, flat: list, new: np.ndarray, rank_of: np.ndarray,
              kvs, width: int) -> None:
    """Apply the run's block allocations in step-by-step order (step, rank, request)."""
    req_idx, step_idx = np.nonzero(new)
    order = np.lexsort((req_idx, step_idx))  # flat order is (rank, running order)
    for i, j in zip(req_idx[order].tolist(), step_idx[order].tolist()):
        req, kv = flat[i], kvs[rank_of[i]]
        saved = req.num_computed_tokens
        req.num_computed_tokens = saved + int(run.cum[j])
        kv.set_time(float(run.start[j]))
        ok = kv.allocate(req, width)
        req.num_computed_tokens = saved
        if not ok:
            raise RuntimeError("fast-forward planned an allocation the pool could not serve")
