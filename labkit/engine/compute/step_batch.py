"""One replica's step as tensors: which tokens at which positions, through which blocks.

The scheduler hands a data plane a `RankBatch`: requests, how many new tokens each gets
and how many it already has KV for. `StepBatch` turns that into what rank-local model
code reads — the same object for every GPU of the replica, never written to:

- the new tokens, flattened request by request: `token_ids`, `positions`, `entry_of`;
- per request (entry): its context before the step, its block table (the KV manager's
  physical block ids, padded with 0), whether it decodes, whether it needs logits;
- for a model with sliding-window layers, a second table per request: the pages those
  layers keep each logical block in, -1 where the block has left the window (the KV
  manager freed it) — `window_table`, padded with -1. Kernels never read entries
  before a query's window; slot ids are only computed for the step's new tokens, whose
  blocks are always held;
- `rows(pcp_index)`: the tokens a PCP rank computes. Each request's new tokens are cut
  into 2·pcp near-equal chunks and rank r takes chunks r and 2·pcp-1-r, so causal
  attention work is balanced (early chunks attend little, late chunks much).

A decoding request's new tokens are its last sampled token plus its drafts (speculative
verify): every one of its rows gets logits. A prompt chunk gets logits only at its last
row, and only when that row completes the prompt (a token is sampled there).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class Entry:
    request_id: str
    context: int  # tokens with KV before the step
    num_new: int
    decode: bool
    table: np.ndarray  # the request's block ids
    samples: bool  # its last row's logits pick a token
    start: int = 0  # first row in the flattened tokens
    window_table: np.ndarray | None = None  # sliding-window layers' pages (-1: freed)
    # linear-attention layers: positions inside the chunk whose state must exist (a
    # snapshot may be taken there; see linear_state.py)
    state_marks: tuple[int, ...] = ()


class StepBatch:
    def __init__(self, entries: list[Entry], token_ids: list[int], block_size: int,
                 pcp: int = 1, device: str | torch.device = "cpu") -> None:
        self.entries = entries
        self.block_size = block_size
        self.pcp = pcp
        self.device = device
        sizes = [e.num_new for e in entries]
        starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        for e, s in zip(entries, starts):
            e.start = int(s)
        self.num_tokens = int(starts[-1])
        self.query_start = starts
        self.token_ids = np.asarray(token_ids, dtype=np.int64)
        self.entry_of = np.repeat(np.arange(len(entries)), sizes).astype(np.int64)
        self.positions = np.concatenate(
            [np.arange(e.context, e.context + e.num_new) for e in entries]
        ).astype(np.int64) if entries else np.zeros(0, np.int64)
        self.is_decode_row = np.repeat([e.decode for e in entries], sizes).astype(bool) \
            if entries else np.zeros(0, bool)
        self.block_table = _pad([e.table for e in entries], 0)
        # (an empty step — an idle DEP replica keeping the collectives in line — has no
        # tables of either kind, and its sliding layers read the empty one)
        self.window_table = _pad([e.window_table for e in entries], -1) \
            if not entries or entries[0].window_table is not None else None
        self.logit_rows = np.array(
            [r for e in entries for r in range(e.start, e.start + e.num_new)
             if e.decode or (e.samples and r == e.start + e.num_new - 1)], dtype=np.int64)
        self._rows = [self._pcp_rows(c) for c in range(pcp)]

    # ------------------------------------------------------------------ rows
    def rows(self, pcp_index: int = 0) -> np.ndarray:
        """Flattened token indices this PCP rank computes, ascending."""
        return self._rows[pcp_index]

    def _pcp_rows(self, c: int) -> np.ndarray:
        if self.pcp == 1:
            return np.arange(self.num_tokens, dtype=np.int64)
        out = []
        for e in self.entries:
            bounds = np.linspace(0, e.num_new, 2 * self.pcp + 1).round().astype(np.int64)
            for chunk in (c, 2 * self.pcp - 1 - c):
                out.append(np.arange(e.start + bounds[chunk], e.start + bounds[chunk + 1]))
        return np.sort(np.concatenate(out)).astype(np.int64) if out else np.zeros(0, np.int64)

    def gathered_order(self, members_pcp: list[int]) -> np.ndarray:
        """Token indices of the rows of `members_pcp` concatenated in that order; used to
        put an all-gathered per-row tensor back into token order."""
        return np.concatenate([self.rows(c) for c in members_pcp]) if members_pcp else \
            np.zeros(0, np.int64)

    # --------------------------------------------------------------- tensors
    def tensor(self, array: np.ndarray, dtype=torch.int64) -> torch.Tensor:
        return torch.as_tensor(array, dtype=dtype, device=self.device)

    def table(self, sliding: bool = False) -> np.ndarray:
        """The block-table matrix of full-attention layers, or of sliding-window ones."""
        if sliding and self.window_table is None:
            raise ValueError("a sliding-window layer ran, but the batch has no window tables "
                             "(the KV manager keeps none for this model)")
        return self.window_table if sliding else self.block_table

    def tables_of(self, rows: np.ndarray, sliding: bool = False) -> np.ndarray:
        """Block table row of each token's request `[len(rows), width]`."""
        return self.table(sliding)[self.entry_of[rows]]


def _pad(tables: list[np.ndarray], fill: int) -> np.ndarray:
    """One int32 row per table, padded with `fill` to the longest (at least 1 wide)."""
    width = max([len(t) for t in tables] + [1])
    out = np.full((len(tables), width), fill, dtype=np.int32)
    for i, t in enumerate(tables):
        out[i, : len(t)] = t
    return out
