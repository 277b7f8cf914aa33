"""Writing the step message: the control plane's side of `step_io.py`.

After the schedulers of an instance have picked their batches, `step_input` turns them
into one `StepInput`. For a plane that only prices steps, the columns the scheduler
already has are enough. For a plane that computes, each request's entry is filled from
what the control plane owns: the request's token stream (the prompt chunk, or the last
token and its n-gram drafts), and from its rank's KV manager the block table, the
sliding-window table, the block boundaries where a linear-attention state must be kept
and the copy-on-write pairs the allocation queued. Tables are copied, so the message
stays valid whatever the KV manager does next.

`Outbox` collects the commands (`step_io`'s copies, snapshots, releases, tier moves)
the control plane decides between steps, in order; the next step's message takes them
all, or the engine hands them over at once (`flush`) before a P/D hand-over, before the
offload checks a block file the pending moves write, and when it runs out of events.
The plane's reports about them come back into the outbox (`receive`) for the part of
the control plane that reads them (the offload, `take_reports`).
"""

from __future__ import annotations

import numpy as np

from labkit.engine.drafter import ngram_drafts
from labkit.engine.step_io import CopyBlocks, Release, RankStep, StepInput


class Outbox:
    """Commands for the data plane, in the order the control plane decided them, and
    the reports that came back about them (`DiskWrite`), until their reader takes them."""

    def __init__(self, plane) -> None:
        self.plane = plane  # where `flush` delivers (the control plane sends, never reads)
        self.commands: list = []
        self.reports: list = []

    def send(self, command) -> None:
        self.commands.append(command)

    def copy_blocks(self, src_dp: int, dst_dp: int, src_blocks, dst_blocks) -> None:
        self.send(CopyBlocks(src_dp, dst_dp, np.array(src_blocks, dtype=np.int64),
                             np.array(dst_blocks, dtype=np.int64)))

    def release(self, request_id: str) -> None:
        self.send(Release(request_id))

    def take(self) -> list:
        out, self.commands = self.commands, []
        return out

    def flush(self) -> None:
        """Deliver the pending commands now."""
        if self.commands:
            self.receive(self.plane.apply(self.take()))

    def receive(self, reports) -> None:
        """The data plane's reports about delivered commands (in a `StepOutput`, or
        from `apply`)."""
        if reports:
            self.reports.extend(reports)

    def take_reports(self, kind: type) -> list:
        """The reports of type `kind`, in order (the others stay for their readers)."""
        out = [r for r in self.reports if isinstance(r, kind)]
        if out:
            self.reports = [r for r in self.reports if not isinstance(r, kind)]
        return out


def step_input(batches, schedulers, work, lockstep: bool, outbox: Outbox | None,
               computes: bool) -> StepInput:
    ranks = [_rank_step(b, s.kv, computes) for b, s in zip(batches, schedulers)]
    commands = outbox.take() if outbox is not None else []
    return StepInput(ranks, work, lockstep, commands)


def _rank_step(batch, kv, computes: bool) -> RankStep:
    step = RankStep(batch.rank, [r.request_id for r in batch.requests],
                    list(batch.num_new_tokens), list(batch.contexts), list(batch.is_decode))
    if not computes:
        return step
    step.token_ids, step.samples, step.block_tables = [], [], []
    step.window_tables, step.state_marks, step.copies = [], [], []
    for req, n, ctx, decode in zip(batch.requests, batch.num_new_tokens, batch.contexts,
                                   batch.is_decode):
        stream = req.token_ids
        new = [stream[ctx]] + ngram_drafts(stream[:ctx + 1], n - 1) if decode \
            else list(stream[ctx:ctx + n])
        rid = req.request_id
        step.token_ids.append(new)
        step.samples.append(not decode and ctx + n == req.num_tokens)
        step.block_tables.append(np.array(kv.table(rid), dtype=np.int32))
        step.window_tables.append(np.array(kv.window_table(rid), dtype=np.int32)
                                  if kv.window is not None else None)
        step.state_marks.append(_state_marks(kv, rid, ctx, n) if kv.snapshots is not None
                                and not decode else ())
        step.copies.append(list(req.pending_copies))
    return step


def _state_marks(kv, request_id: str, ctx: int, n: int) -> tuple[int, ...]:
    """Where a prompt chunk must stop to keep the linear state: its last block boundary
    (a call ending soon snapshots there) and the boundary the control plane wants a
    snapshot at (a prefix seen the second time)."""
    bs, end = kv.block_size, ctx + n
    wanted = {end // bs * bs, kv.snapshot_boundary(request_id) * bs}
    return tuple(sorted(p for p in wanted if ctx < p < end))
