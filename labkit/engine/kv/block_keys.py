"""Block keys: the names under which full KV blocks enter the prefix cache.

Two blocks may share KV only if they hold the same tokens *after the same prefix*;
vLLM gets that by chaining hashes (each block's hash covers its parent's hash). Trace
hash ids already have that property once the trace loader has made them
*chain-unique* (the same id never appears after two different prefixes), so a trace
block's id alone is a valid key and no chaining is needed at run time. That is what
keeps a turn's prefix lookup independent of its context length.

The engine's block size B and the trace's block size T need not match:

- B <= T (say 16 vs 64): engine block j is sub-block ``j % (T/B)`` of trace block
  ``j // (T/B)``; its key combines the two (sub-blocks chain from the trace id) — but
  where a call's context ends inside a trace block, the sub-blocks it filled are keyed
  as the call that first filled them keys them (`TraceBlockKeys.lend`), as a
  successor's fuller block has another id.
- B > T: an engine block spans T/B trace blocks; the id of the *last* of them already
  names the whole prefix, so it is the key.

A `salt` (a multiple of 2**42) separates otherwise identical content that must not
share KV, e.g. a session replayed a second time as a new user.

Requests that carry real token ids (the compute plane, or a user's own prompts) use
`TokenBlockKeys` instead: vLLM-style chained hashes over the tokens of each block.
"""

from __future__ import annotations

import hashlib

import numpy as np
from numba import njit

from labkit.errors import ConfigError

ID_LIMIT = 1 << 42  # trace ids live below this; salts are multiples of it

# Pages that belong to a block without being its full-attention KV (a linear-attention
# state snapshot taken after it, its sliding-window layers' KV) are cached under keys
# derived from the block's key, one namespace per kind.
SNAPSHOT_NAMESPACE = 1
WINDOW_NAMESPACE = 2


def derived_keys(namespace: int, block_key: int, count: int) -> np.ndarray:
    """Keys of `count` pages of kind `namespace` attached to the block named
    `block_key` (tuples of ints hash the same in every process)."""
    return np.array([hash((namespace, int(block_key), i)) for i in range(count)],
                    dtype=np.int64)


def check_block_sizes(block_size: int, trace_block_size: int) -> None:
    big, small = max(block_size, trace_block_size), min(block_size, trace_block_size)
    if big % small:
        raise ConfigError(
            f"block_size={block_size} and the trace's block size {trace_block_size} must "
            f"divide one another (e.g. block_size {trace_block_size} or a divisor of it)"
        )


class TraceBlockKeys:
    """Keys of one request's engine blocks, from the trace ids of its context.

    With B < T a trace id is too coarse where a call's context ends inside a trace
    block: the next call to re-send that context fills the block further and has
    another id for it, yet the engine sub-blocks the first call filled hold the same
    tokens in both — vLLM's token hashes share them. So a call keys those sub-blocks
    as its parent does (`lend`): keys of the sub-blocks `lent_at` (ascending) are
    `lent_keys`, the others come from the ids. Lent keys pass down a thread of calls
    as far as each re-sends its parent's context.
    """

    __slots__ = ("ids", "block_size", "trace_block_size", "_ratio", "_split", "num_blocks",
                 "lent_at", "lent_keys")

    def __init__(self, context_ids: np.ndarray, trace_block_size: int, block_size: int,
                 salt: int = 0) -> None:
        self.ids = context_ids + salt if salt else context_ids
        self.block_size = block_size
        self.trace_block_size = trace_block_size
        self._split = block_size <= trace_block_size
        if self._split:
            self._ratio = trace_block_size // block_size
            self.num_blocks = len(self.ids) * self._ratio  # blocks with a defined key
        else:
            self._ratio = block_size // trace_block_size
            self.num_blocks = len(self.ids) // self._ratio
        self.lent_at, self.lent_keys = NO_KEYS, NO_KEYS

    def lend(self, parent: TraceBlockKeys, shared_tokens: int) -> None:
        """Key the engine blocks inside this call's first `shared_tokens` tokens (its
        parent's context, re-sent) as `parent` keys them where the ids may not: the
        parent's own lent keys there, and the whole sub-blocks of the trace block the
        shared part ends in, if the two calls' ids for it differ. Nothing to do with
        B >= T (an engine block never ends inside a trace block)."""
        if not self._split:
            return
        r = self._ratio
        i, sub = divmod(shared_tokens, self.trace_block_size)
        whole = sub // self.block_size
        part = whole > 0 and i < len(self.ids) and i < len(parent.ids) \
            and self.ids[i] != parent.ids[i]
        inherited = int(np.searchsorted(parent.lent_at, i * r if part else
                                        shared_tokens // self.block_size))
        at, keys = parent.lent_at[:inherited], parent.lent_keys[:inherited]
        if part:  # (the parent's keys there, its lent ones included)
            at = np.concatenate((at, np.arange(i * r, i * r + whole, dtype=np.int64)))
            keys = np.concatenate((keys, parent.keys(i * r, i * r + whole)))
        self.lent_at, self.lent_keys = at, keys

    def key(self, j: int) -> int:
        r = self._ratio
        if not self._split:
            return int(self.ids[(j + 1) * r - 1])
        lent = self.lent_at
        if len(lent) and lent[0] <= j <= lent[-1]:
            p = int(np.searchsorted(lent, j))
            if lent[p] == j:
                return int(self.lent_keys[p])
        # (wrapping as int64 arithmetic does: what the compiled `keys` computes)
        return _int64(int(self.ids[j // r]) * r + j % r)

    def recipe(self) -> tuple:
        """(ids, ratio, split, lent_at, lent_keys): what `_trace_keys` makes the keys
        from, for compiled loops that compute keys as they go
        (`BlockPool.cached_trace_prefix`)."""
        return self.ids, self._ratio, self._split, self.lent_at, self.lent_keys

    def keys(self, start: int, stop: int) -> np.ndarray:
        """key(j) for j in [start, stop) (one compiled loop: lookups and registrations
        ask for a handful of keys most of the time, for thousands now and then)."""
        if not (0 <= start and stop <= self.num_blocks):
            raise IndexError(f"keys {start}..{stop} of a request with {self.num_blocks} "
                             f"keyed blocks")
        return _trace_keys(*self.recipe(), start, stop)


NO_KEYS = np.empty(0, dtype=np.int64)


def _int64(x: int) -> int:
    """x wrapped into int64's range (what an int64 sum or product gives)."""
    return (x + (1 << 63)) % (1 << 64) - (1 << 63)


@njit(cache=True)
def _trace_keys(ids, r: int, split: bool, lent_at, lent_keys, start: int, stop: int):
    out = np.empty(max(stop - start, 0), dtype=np.int64)
    for j in range(start, stop):
        out[j - start] = ids[j // r] * r + j % r if split else ids[(j + 1) * r - 1]
    for p in range(len(lent_at)):  # (a handful, if any)
        if start <= lent_at[p] < stop:
            out[lent_at[p] - start] = lent_keys[p]
    return out


class TokenBlockKeys:
    """Keys of a request's blocks from its token ids, chained as vLLM chains them.

    Key j hashes (key j-1, the block's tokens, extra keys such as a LoRA adapter), so
    it names the whole prefix. Keys are computed lazily and remembered; the stream
    may grow (`extend`, as tokens are generated) and only new blocks get hashed.
    """

    __slots__ = ("tokens", "block_size", "extra", "_keys")

    def __init__(self, token_ids, block_size: int, extra=None) -> None:
        self.tokens = [int(t) for t in token_ids]
        self.block_size = block_size
        self.extra = extra
        self._keys: list[int] = []

    @property
    def num_blocks(self) -> int:
        return len(self.tokens) // self.block_size

    def extend(self, token_ids) -> None:
        self.tokens.extend(int(t) for t in token_ids)

    def head(self, num_tokens: int) -> TokenBlockKeys:
        """Keys of the stream's first `num_tokens` tokens, to grow apart from these
        (what is hashed already is kept: the keys are the same up there)."""
        out = TokenBlockKeys((), self.block_size, self.extra)
        out.tokens = self.tokens[:num_tokens]
        out._keys = self._keys[: num_tokens // self.block_size]
        return out

    def _fill(self, stop: int) -> None:
        bs, keys = self.block_size, self._keys
        parent = keys[-1] if keys else _stable_seed(self.extra)
        for j in range(len(keys), stop):
            parent = hash((parent, tuple(self.tokens[j * bs : (j + 1) * bs])))
            keys.append(parent)

    def key(self, j: int) -> int:
        if j >= len(self._keys):
            self._fill(j + 1)
        return self._keys[j]

    def keys(self, start: int, stop: int) -> np.ndarray:
        if stop > len(self._keys):
            self._fill(stop)
        return np.array(self._keys[start:stop], dtype=np.int64)


def _stable_seed(extra) -> int:
    """The chain's root from its extra keys, the same in every process (Python's own
    str hash is salted per process; int tuples hash deterministically)."""
    digest = hashlib.blake2b(repr(extra).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)
