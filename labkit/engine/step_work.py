"""StepWork: what a step asks of each rank, in the few numbers a cost model needs.

A step's batch on one rank is a list of (new tokens, context) pairs. Its cost depends
on a handful of sums over that list — tokens to push through the weights, KV tokens
to read, query-key pairs to score — so the cost model sees those sums, not the list.
Every field is an integer array of shape (steps, ranks): one step of a whole
instance is shape (1, R); a fast-forwarded run of k decode steps is (k, R), and the
same cost formula evaluates both, so the two can never disagree.

Both planes use these types: every `StepInput` carries its step's `StepWork`, and
every data plane answers with a `StepTiming` (a simulated plane from its cost model, the
compute plane from its clock) — so they live beside the step message (`step_io.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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
    # One step only: every prefill chunk as (rank, new tokens, context) columns, so a
    # cost model can price each chunk's attention on its own shape.
    prefill_chunks: tuple | None = None
    chunk_share: object = 1.0  # a micro-batch carries 1 / chunk_share of those chunks

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
            for n, ctx, decode in zip(batch.num_new_tokens, batch.contexts, batch.is_decode):
                pairs = n * ctx + n * (n + 1) // 2
                if decode:
                    cols[1, r] += n
                    cols[3, r] += 1
                    cols[6, r] += pairs
                    cols[7, r] += ctx
                else:
                    cols[0, r] += n
                    cols[2, r] += 1
                    cols[5, r] += pairs
                    chunk_rank.append(r)
                    chunk_new.append(n)
                    chunk_ctx.append(ctx)
                cols[4, r] += ctx + n
        idle = (cols[2] + cols[3]) == 0
        chunks = (np.array(chunk_rank, dtype=np.int64), np.array(chunk_new, dtype=np.int64),
                  np.array(chunk_ctx, dtype=np.int64))
        return cls(*(c[None, :] for c in cols[:7]), idle=idle[None, :],
                   decode_context=cols[7][None, :], prefill_chunks=chunks)

    def head(self, k: int) -> StepWork:
        """The first k steps."""
        return StepWork(*(getattr(self, f)[:k] for f in StepWork.__slots__[:9]),
                        prefill_chunks=self.prefill_chunks, chunk_share=self.chunk_share)


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
