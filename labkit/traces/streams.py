"""Growing conversations, and how their block ids are minted.

An agent's context only ever grows (until it is compacted): each call's prompt is
the previous prompt + the previous output + new text. A ``TokenStream`` tracks
such a context as a token count plus the ids of its *full* blocks.

Ids follow content, so a generated trace is chain-unique by construction:

* a block gets a fresh id the moment it becomes full, and keeps it -- every later
  prompt of this conversation (and of any fork) re-uses that id;
* a prompt whose last block is partial gets a fresh id for that partial block:
  its content (a few tokens) differs from the full block it later becomes;
* a fork (a subagent inheriting the main agent's context) copies the full-block
  ids, then grows on its own, so the fork and the original diverge at the first
  block holding different content.

Ids are consecutive integers from one ``IdMinter`` per trace, so generation is
deterministic and ids are dense (cheap to index tables with).
"""
from __future__ import annotations

import numpy as np


class IdMinter:
    """Hands out fresh block ids (consecutive integers)."""

    __slots__ = ("next_id",)

    def __init__(self, first_id: int = 0):
        self.next_id = first_id

    def take(self, n: int) -> np.ndarray:
        ids = np.arange(self.next_id, self.next_id + n, dtype=np.int64)
        self.next_id += n
        return ids

    def one(self) -> int:
        self.next_id += 1
        return self.next_id - 1


class TokenStream:
    """A growing context: ``tokens`` so far and the ids of its full blocks."""

    __slots__ = ("_ids", "_minter", "block_size", "tokens")

    def __init__(self, block_size: int, minter: IdMinter, prefix_ids: np.ndarray,
                 prefix_tokens: int):
        """Start from a shared prefix of ``prefix_tokens`` whose full blocks have
        ``prefix_ids`` (every stream started this way shares those ids)."""
        assert len(prefix_ids) == prefix_tokens // block_size
        self.block_size = block_size
        self.tokens = prefix_tokens
        self._minter = minter
        self._ids = np.empty(max(1024, 2 * len(prefix_ids)), dtype=np.int64)
        self._ids[:len(prefix_ids)] = prefix_ids

    @property
    def full_blocks(self) -> int:
        return self.tokens // self.block_size

    def append(self, n_tokens: int) -> None:
        """Add ``n_tokens`` of new content; blocks that become full get fresh ids."""
        before = self.full_blocks
        self.tokens += n_tokens
        after = self.full_blocks
        if after > len(self._ids):  # grow the buffer geometrically
            bigger = np.empty(max(after, 2 * len(self._ids)), dtype=np.int64)
            bigger[:before] = self._ids[:before]
            self._ids = bigger
        self._ids[before:after] = self._minter.take(after - before)

    def prompt_ids(self) -> np.ndarray:
        """Ids of a prompt made of the whole stream: a new array the caller owns
        (the stream's buffer keeps changing)."""
        full = self._ids[:self.full_blocks]
        if not self.tokens % self.block_size:
            return full.copy()
        ids = np.empty(len(full) + 1, dtype=np.int64)  # + the partial block's fresh id
        ids[:-1] = full
        ids[-1] = self._minter.one()
        return ids

    def fork(self) -> TokenStream:
        """An independent stream with the same content so far (a subagent)."""
        full = self.full_blocks
        child = TokenStream.__new__(TokenStream)
        child.block_size, child.tokens, child._minter = self.block_size, self.tokens, self._minter
        child._ids = np.empty(max(1024, 2 * full), dtype=np.int64)
        child._ids[:full] = self._ids[:full]
        return child
