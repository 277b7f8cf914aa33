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
ranks (a linear-attention model's state with it, `FetchState`), save or restore a
linear-attention state snapshot, release a finished request's per-request state, the
offload tiers' block `Move`s (`TierMoves`), and a P/D hand-over's two halves
(`ExportKV` on the prefill side's plane, `ImportKV` on the decode side's). They
describe what the control plane already did to its bookkeeping; the data plane makes
it true on its bytes. What the data plane has to tell back comes
back as reports, in the `StepOutput` (or from `apply`): a block file written, with its
path and digest, or not writable (`DiskWrite`) — the control plane acts on it itself,
as vLLM's scheduler acts on the failed loads its KV connector reports — and a
hand-over's bytes (`KVExported`), which the control plane passes on unopened.
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
class FetchState:
    """A session's prefix fetched from another DP rank (with its `CopyBlocks`), for a
    hybrid model: the snapshot `key` on DP rank src_dp becomes request_id's state after
    `position` tokens on dst_dp."""

    src_dp: int
    dst_dp: int
    key: int
    request_id: str
    position: int


@dataclass(slots=True)
class Release:
    """A request finished (or its KV was handed on): its per-request state goes."""

    request_id: str


@dataclass(slots=True)
class TierMoves:
    """Blocks the control plane moved between the GPU and the offload tiers of node
    store `store` (`kv/tiers.py` `Move`s, in order): copy the bytes along."""

    store: int
    moves: list


@dataclass(slots=True)
class KVSpan:
    """Positions start..stop-1 of a request's KV, in the blocks `table` (its block ids
    on that plane; for a sliding-window model's window layers, its window table); of
    `layers` only, if given."""

    table: np.ndarray
    start: int
    stop: int
    layers: list[int] | None = None


@dataclass(slots=True)
class ExportKV:
    """P/D hand-over, prefill side: read request_id's KV `spans` on DP rank dp (and, for
    a hybrid model, its linear-attention state after `state_position` tokens — with
    `state_boundary`, also after the last block boundary before it, where the decode
    side may snapshot it) into a `KVExported` report named `transfer`."""

    transfer: str
    dp: int
    request_id: str
    spans: list[KVSpan]
    state_position: int | None = None
    state_boundary: bool = False


@dataclass(slots=True)
class ImportKV:
    """P/D hand-over, decode side: write an exported `payload` into request_id's blocks
    on DP rank dp (`spans`: this plane's tables, in the export's order)."""

    dp: int
    request_id: str
    spans: list[KVSpan]
    payload: object
    state_position: int | None = None


Command = CopyBlocks | SaveState | RestoreState | FetchState | Release | TierMoves | ExportKV \
    | ImportKV


# ------------------------------------------------------------------- reports
@dataclass(slots=True)
class DiskWrite:
    """A block the data plane wrote to the disk tier: its file (`path`) and the
    blake2b digest of the file's bytes — what the control plane checks before it
    loads the block — or `path=None`: the disk could not take it."""

    store: int
    key: int
    path: str | None = None
    digest: bytes | None = None


@dataclass(slots=True)
class KVExported:
    """The bytes an `ExportKV` read: opaque to the control plane, which hands them to
    the decode side's plane in an `ImportKV` (across processes, they travel pickled)."""

    transfer: str
    payload: object


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
    sampled token after a prompt's last chunk), and the reports of the step's commands."""

    timing: StepTiming
    tokens: dict[str, list[int]] | None = None
    reports: list = field(default_factory=list)  # about the commands (`DiskWrite`, ...)


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

    def apply(self, commands: list) -> list: ...  # the commands' reports

    def close(self) -> None: ...
