"""StepWork: what a step asks of each rank, in the few numbers a cost model needs.

A step's batch on one rank is a list of (new tokens, context) pairs. Its cost depends
on a handful of sums over that list — tokens to push through the weights, KV tokens
to read, query-key pairs to score — so the cost model sees those sums, not the list.
Every field is an integer array of shape (steps, ranks): one step of a whole
instance is shape (1, R); a fast-forwarded run of k steps is (k, R), and the same
cost formula evaluates both, so the two can never disagree. Prefill chunks, whose
attention is priced on each chunk's own shape, are listed besides as (rank, new
tokens, context, step) columns — step 0 for a single step, the row for a run.

Both planes use these types: every `StepInput` carries its step's `StepWork`, and
every data plane answers with a `StepTiming` (a simulated plane from its cost model, the
compute plane from its clock) — so they live beside the step message (`step_io.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit


@dataclass(slots=True)
class StepWork:
    prefill_tokens: np.ndarray  # new prompt (or recomputed) tokens
    decode_tokens: np.ndarray  # decode tokens, drafts included
    num_prefill_reqs: np.ndarray
    num_decode_reqs: np.ndarray
    kv_read_tokens: np.ndarray  # sum over requests of context + new tokens (KV touched)
    prefill_pairs: np.ndarray  # query-key pairs of prefill tokens (causal)
    decode_pairs: np.ndarray  # query-key pairs of decode tokens
    idle: np.ndarray  # bool: the rank had nothing to do (runs a dummy step in lockstep)
    decode_context: np.ndarray | None = None  # sum of decoding requests' contexts
    # every prefill chunk as (rank, new tokens, context, step) columns, so a cost model
    # can price each chunk's attention on its own shape (step: the row it belongs to;
    # listed step by step)
    prefill_chunks: tuple | None = None
    chunk_share: object = 1.0  # a micro-batch carries 1 / chunk_share of those chunks
    # every step (row) has the same counts — tokens and requests of each kind, idle —
    # as a run of decodes has (`run_plan.decode_work`): a cost model may price them
    # once (False: not known)
    same_counts: bool = False

    def __post_init__(self) -> None:
        if self.decode_context is None:
            self.decode_context = np.zeros_like(self.decode_tokens)

    @property
    def tokens(self) -> np.ndarray:
        return self.prefill_tokens + self.decode_tokens

    @property
    def num_reqs(self) -> np.ndarray:
        return self.num_prefill_reqs + self.num_decode_reqs

    @classmethod
    def from_batches(cls, batches) -> StepWork:
        """One step: a (1, R) StepWork from the ranks' RankBatch objects."""
        cols = np.zeros((8, len(batches)), dtype=np.int64)
        chunk_rank, chunk_new, chunk_ctx = [], [], []
        for r, batch in enumerate(batches):
            if not batch.requests:
                continue
            # (Python integers, summed a rank at a time: a step of hundreds of requests)
            p_tok = d_tok = p_reqs = p_pairs = d_pairs = d_ctx = 0
            for n, ctx, decode in zip(batch.num_new_tokens, batch.contexts, batch.is_decode):
                if decode:
                    d_tok += n
                    d_pairs += n * ctx + n * (n + 1) // 2
                    d_ctx += ctx
                else:
                    p_tok += n
                    p_reqs += 1
                    p_pairs += n * ctx + n * (n + 1) // 2
                    chunk_rank.append(r)
                    chunk_new.append(n)
                    chunk_ctx.append(ctx)
            d_reqs = len(batch.requests) - p_reqs
            kv_read = sum(batch.contexts) + p_tok + d_tok
            cols[:, r] = (p_tok, d_tok, p_reqs, d_reqs, kv_read, p_pairs, d_pairs, d_ctx)
        idle = (cols[2] + cols[3]) == 0
        chunks = (np.array(chunk_rank, dtype=np.int64), np.array(chunk_new, dtype=np.int64),
                  np.array(chunk_ctx, dtype=np.int64), np.zeros(len(chunk_rank), np.int64))
        return cls(*(c[None, :] for c in cols[:7]), idle=idle[None, :],
                   decode_context=cols[7][None, :], prefill_chunks=chunks)

    @classmethod
    def from_entries(cls, rank_of, ranks: int, context: np.ndarray, new: np.ndarray,
                     prefill: np.ndarray) -> StepWork:
        """k steps (a run) from its requests' entries, (n, k) arrays: request i, on rank
        rank_of[i], computes new[i, j] tokens over context[i, j] in step j (0: it sits
        the step out), a prefill chunk where prefill[i, j]. The sums `from_batches`
        makes of each step, with the chunks in its order (by rank, then request)."""
        sums, chunks = _entry_sums(np.asarray(rank_of, dtype=np.int64), ranks, context, new,
                                   prefill)
        return cls(*sums[:7], idle=(sums[2] + sums[3]) == 0, decode_context=sums[7],
                   prefill_chunks=tuple(chunks))

    def rows(self, start: int, stop: int) -> StepWork:
        """Steps [start, stop) (their chunks renumbered from 0); itself if that is all."""
        if start == 0 and stop >= len(self.prefill_tokens):
            return self  # (never written: the same as a copy of its rows)
        chunks = self.prefill_chunks
        if chunks is not None and len(chunks) == 4 and len(chunks[0]):
            # (listed step by step: the chunks of these steps are one slice)
            lo, hi = chunks[3].searchsorted((start, stop)).tolist()
            chunks = (*(c[lo:hi] for c in chunks[:3]), chunks[3][lo:hi] - start)
        s = slice(start, stop)
        return StepWork(self.prefill_tokens[s], self.decode_tokens[s],
                        self.num_prefill_reqs[s], self.num_decode_reqs[s],
                        self.kv_read_tokens[s], self.prefill_pairs[s], self.decode_pairs[s],
                        self.idle[s], self.decode_context[s], prefill_chunks=chunks,
                        chunk_share=self.chunk_share, same_counts=self.same_counts)

    def head(self, k: int) -> StepWork:
        """The first k steps."""
        return self.rows(0, k)

    @staticmethod
    def joined(parts: list) -> StepWork:
        """Consecutive steps of decodes alone (no chunks listed), one after another."""
        if any(p.prefill_chunks is not None and len(p.prefill_chunks[0]) for p in parts):
            raise ValueError("StepWork.joined takes steps without prefill chunks")
        names = ("prefill_tokens", "decode_tokens", "num_prefill_reqs", "num_decode_reqs",
                 "kv_read_tokens", "prefill_pairs", "decode_pairs", "idle", "decode_context")
        return StepWork(*(np.concatenate([getattr(p, n) for p in parts]) for n in names),
                        chunk_share=parts[0].chunk_share)


# (one signature: any layout of the arrays is one compiled copy, loaded once a process)
@njit("(int64[:], int64, int64[:, :], int64[:, :], boolean[:, :])", cache=True)
def _entry_sums(rank_of, ranks: int, context, new, prefill):
    """`from_entries` in one pass: the eight (k, ranks) sums — prefill and decode tokens,
    prefill and decode requests, KV read, prefill and decode query-key pairs, decoding
    context — and the chunks' (rank, new, context, step) columns, step by step."""
    n, k = new.shape
    sums = np.zeros((8, k, ranks), dtype=np.int64)
    chunks = np.empty((4, n * k), dtype=np.int64)
    m = 0
    for j in range(k):
        for i in range(n):
            t, ctx, r = new[i, j], context[i, j], rank_of[i]
            pairs = t * ctx + t * (t + 1) // 2
            if t > 0:
                sums[4, j, r] += ctx + t
            if prefill[i, j]:
                sums[0, j, r] += t
                sums[2, j, r] += 1
                sums[5, j, r] += pairs
                chunks[0, m], chunks[1, m], chunks[2, m], chunks[3, m] = r, t, ctx, j
                m += 1
            elif t > 0:  # (0: not in the step)
                sums[1, j, r] += t
                sums[3, j, r] += 1
                sums[6, j, r] += pairs
                sums[7, j, r] += ctx
    return sums, chunks[:, :m]


def rank_sums(values: np.ndarray, rank_of, ranks: int) -> np.ndarray:
    """values summed over the requests of each rank (the last axis: requests -> ranks);
    integer sums, so the order of the additions does not matter."""
    if ranks == 1:
        return values.sum(axis=-1, keepdims=True)
    out = np.zeros(values.shape[:-1] + (ranks,), dtype=values.dtype)
    np.add.at(out, (..., np.asarray(rank_of)), values)
    return out


@dataclass(slots=True)
class StepTiming:
    """What a cost model says about (steps, ranks): each rank's own busy seconds and
    their compute / communication parts, each step's duration (the slowest rank under
    lockstep), and the temporary KV bytes a GPU held while the step ran."""

    busy: np.ndarray
    compute: np.ndarray
    comm: np.ndarray
    duration: np.ndarray  # (steps,)
    temporary_kv_bytes: np.ndarray

    @property
    def stall(self) -> np.ndarray:
        return self.duration[:, None] - self.busy

    def rows(self, start: int, stop: int | None = None) -> StepTiming:
        """Steps [start, stop) (to the last when stop is None); itself if that is all."""
        if start == 0 and (stop is None or stop >= len(self.duration)):
            return self
        return type(self)(*(a[start:stop] for a in self._arrays()))

    def head(self, k: int) -> StepTiming:
        """The first k steps."""
        return self.rows(0, k)

    @staticmethod
    def joined(parts: list) -> StepTiming:
        """Consecutive steps' timings, one after another."""
        arrays = zip(*(p._arrays() for p in parts))
        return type(parts[0])(*(np.concatenate(a) for a in arrays))

    def _arrays(self) -> tuple:
        return self.busy, self.compute, self.comm, self.duration, self.temporary_kv_bytes
