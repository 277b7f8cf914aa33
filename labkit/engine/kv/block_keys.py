"""Block keys: the names under which full KV blocks enter the prefix cache.

Two blocks may share KV only if they hold the same tokens *after the same prefix*;
vLLM gets that by chaining hashes (each block's hash covers its parent's hash). Trace
hash ids already have that property once the trace loader has made them
*chain-unique* (the same id never appears after two different prefixes), so a trace
block's id alone is a valid key and no chaining is needed at run time. That is what
keeps a turn's prefix lookup independent of its context length.

The engine's block size B and the trace's block size T need not match:

- B <= T (say 16 vs 64): engine block j is sub-block ``j % (T/B)`` of trace block
  ``j // (T/B)``; its key combines the two (sub-blocks chain from the trace id).
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
    """Keys of one request's engine blocks, from the trace ids of its context."""

    __slots__ = ("ids", "block_size", "trace_block_size", "_ratio", "_split", "num_blocks")

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

    def key(self, j: int) -> int:
        r = self._ratio
        if self._split:
            return int(self.ids[j // r]) * r + j % r
        return int(self.ids[(j + 1) * r - 1])

    def recipe(self) -> tuple:
        """(ids, ratio, split): what `_trace_keys` makes the keys from, for compiled
        loops that compute keys as they go (`BlockPool.cached_trace_prefix`)."""
        return self.ids, self._ratio, self._split

    def keys(self, start: int, stop: int) -> np.ndarray:
        """key(j) for j in [start, stop) (one compiled loop: lookups and registrations
        ask for a handful of keys most of the time, for thousands now and then)."""
        if not (0 <= start and stop <= self.num_blocks):
            raise IndexError(f"keys {start}..{stop} of a request with {self.num_blocks} "
                             f"keyed blocks")
        return _trace_keys(self.ids, self._ratio, self._split, start, stop)


@njit(cache=True)
def _trace_keys(ids, r: int, split: bool, start: int, stop: int):
    out = np.empty(max(stop - start, 0), dtype=np.int64)
    for j in range(start, stop):
        out[j - start] = ids[j // r] * r + j % r if split else ids[(j + 1) * r - 1]
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
