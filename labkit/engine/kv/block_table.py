"""Block tables, and what a finished request leaves behind for its successor.

- `BlockTable`: a running request's logical -> physical block map (grows as it
  computes; `num_keyed` leading blocks are registered in the prefix cache, of which
  `num_written` hold computed KV that has been passed on: offload write-through);
- `PrefixHint`: the cached blocks a finished (or preempted) call left on its rank, so
  the session's next call finds its prefix in O(log n) probes (`KVManager.lookup`);
- `PrefixMatch`: a lookup's answer — the reusable blocks and the tokens they hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

EMPTY = np.empty(0, dtype=np.int32)


@dataclass(slots=True)
class PrefixHint:
    """What a finished (or preempted) request left behind on its rank.

    `blocks` are its leading cached blocks with their generations at that moment;
    `tail` is its last, partly filled block (if any) — never cached by key, but still
    intact until reallocated, which a forked child may adopt.
    """

    rank: int
    blocks: np.ndarray
    generations: np.ndarray
    num_tokens: int = 0  # tokens with KV in the table when it was freed
    tail: int = -1
    tail_generation: int = -1


@dataclass(slots=True)
class PrefixMatch:
    """A request's reusable prefix on one rank: physical blocks and tokens they hold."""

    blocks: np.ndarray
    num_tokens: int
    forked: bool = False  # ends in a partly filled block adopted from the parent
    # hybrid models (state_snapshots.py): KV blocks cached, of which usable (a state
    # snapshot ends the prefix) are `num_tokens`; where a snapshot is worth saving
    cached_blocks: int = 0
    checkpoint_blocks: int = 0
    # sliding-window models: the cached SWA pages of the prefix's last blocks
    window_pages: np.ndarray | None = None


NO_MATCH = PrefixMatch(EMPTY, 0)


class BlockTable:
    __slots__ = ("blocks", "n", "num_keyed", "num_written", "num_shared")

    def __init__(self, capacity: int) -> None:
        self.blocks = np.empty(max(capacity, 1), dtype=np.int32)
        self.n = 0
        self.num_keyed = 0  # leading blocks already registered in the prefix cache
        self.num_written = 0  # ... whose KV is computed and written through
        # leading blocks another table may hold too: those it opened with (a prefix hit,
        # a forked parent's), or that a child forked from it shares. A block it took
        # itself and has not keyed (`num_keyed`; a P/D hand-over keys its prompt's last
        # block before it has computed it all) is its own while it lives: nobody hits a
        # block before it is keyed, nor adopts a partly filled one but from a table
        # that is gone (`KVManager._needs_copy`).
        self.num_shared = 0

    def view(self) -> np.ndarray:
        return self.blocks[: self.n]

    def extend(self, new: np.ndarray) -> None:
        end = self.n + len(new)
        if end > len(self.blocks):
            grown = np.empty(max(end, 2 * len(self.blocks)), dtype=np.int32)
            grown[: self.n] = self.blocks[: self.n]
            self.blocks = grown
        self.blocks[self.n : end] = new
        self.n = end
