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
"""

from __future__ import annotations

import numpy as np

from labkit.errors import ConfigError

ID_LIMIT = 1 << 42  # trace ids live below this; salts are multiples of it


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

    def keys(self, start: int, stop: int) -> np.ndarray:
        j = np.arange(start, stop, dtype=np.int64)
        r = self._ratio
        if self._split:
            return self.ids[j // r] * r + j % r
        return self.ids[(j + 1) * r - 1]
