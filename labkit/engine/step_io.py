"""The seam between the control plane and a data plane: one message each way per step.

The control plane (scheduler, KV manager, router) decides; a data plane (the simulated
cluster, or real tensors) carries a step out. Everything a data plane needs for a step
travels in one `StepInput`, and everything it tells back in one `StepOutput` — as vLLM's
workers receive a `SchedulerOutput` and answer a `ModelRunnerOutput`. A data plane
holds no reference to a scheduler, a KV manager or an engine, and never calls back:
that is what lets a rank live in another process, or on another machine.

A `StepInput` holds, per DP rank of the stepping instance, a `RankStep` in columns
(one entry per scheduled request): its id, how many tokens it had before the step
(`contexts`) and gets now, whether it decodes. A plane that computes
(`DataPlane.computes`) also gets what the KV manager knows: each request's new token
ids (a decode's last token and its n-gram drafts), its block table, its sliding-window
table, the positions where a linear-attention state must be kept (`state_marks`), and
its copy-on-write block pairs. The KV manager's numbers are copied in, so the message
is plain ints, lists and numpy arrays: it pickles.

Besides the step itself the control plane sends **commands**, in the order it decided
them, applied before the step's forward (or at once with `DataPlane.apply` when the
control plane is about to read or move bytes itself): copy a fetched prefix between DP
ranks, save or restore a linear-attention state snapshot, release a finished request's
per-request state. Like the offload tiers' `Move`s, they describe what the control
plane already did to its bookkeeping; the data plane makes it true on its bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from labkit.engine.step_work import StepTiming, StepWork


# ------------------------------------------------------------------ commands
@dataclass(slots=True)
class CopyBlocks:
    """A prefix fetched from DP rank src_dp: copy its blocks into dst_dp's."""

    src_dp: int
    dst_dp: int
    src_blocks: np.ndarray
    dst_blocks: np.ndarray


@dataclass(slots=True)
class SaveState:
    """Snapshot request_id's linear-attention state after `position` tokens under
    `key`; drop the snapshots the control plane has evicted since (`dropped`)."""

    dp: int
    key: int
    request_id: str
    position: int
    dropped: list[int] = field(default_factory=list)


@dataclass(slots=True)
class RestoreState:
    """request_id resumes from the snapshot `key` (its state after `position` tokens)."""

    dp: int
    key: int
    request_id: str
    position: int


@dataclass(slots=True)
class Release:
    """A request finished (or its KV was handed on): its per-request state goes."""

    request_id: str


Command = CopyBlocks | SaveState | RestoreState | Release


# --------------------------------------------------------------- the step
@dataclass(slots=True)
class RankStep:
    """One DP rank's requests in a step, in columns (one entry per request)."""

    rank: int
    request_ids: list[str]
    num_new_tokens: list[int]
    contexts: list[int]  # tokens with KV before the step
    is_decode: list[bool]
    # filled for a plane that computes (None otherwise)
    token_ids: list[list[int]] | None = None  # the new tokens (decode: last + drafts)
    samples: list[bool] | None = None  # a prompt's last chunk: its last row picks a token
    block_tables: list[np.ndarray] | None = None
    window_tables: list[np.ndarray | None] | None = None  # sliding layers (-1: freed)
    state_marks: list[tuple[int, ...]] | None = None  # positions whose state to keep
    copies: list[list[tuple[int, int]]] | None = None  # copy-on-write (src, dst) blocks

    def __len__(self) -> int:
        return len(self.request_ids)


@dataclass(slots=True)
class StepInput:
    """One step of one instance: its ranks' requests, the commands before it, and the
    step's `work` (the sums a cost model prices, `step_work.py`)."""

    ranks: list[RankStep]
    work: StepWork
    lockstep: bool = False
    commands: list = field(default_factory=list)

    @property
    def finished_ids(self) -> list[str]:
        return [c.request_id for c in self.commands if isinstance(c, Release)]


@dataclass(slots=True)
class StepOutput:
    """What a step took (per rank and overall, `StepTiming`) and, on a plane that
    computes, the token ids each request produced (a decode's verified tokens; one
    sampled token after a prompt's last chunk)."""

    timing: StepTiming
    tokens: dict[str, list[int]] | None = None


class DataPlane(Protocol):
    """What the control plane needs of a data plane.

    `computes`: real tensors (the step message carries token ids and tables, outputs
    carry tokens). `supports_runs`: whole runs of decode steps can be costed at once
    (then `cost_model` is the step model). `min_step_s` > 0 bounds every step.
    """

    computes: bool
    supports_runs: bool

    @property
    def min_step_s(self) -> float: ...

    def execute(self, step: StepInput) -> StepOutput: ...

    def apply(self, commands: list) -> None: ...

    def close(self) -> None: ...
