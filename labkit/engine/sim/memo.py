"""An exact memo for the step model's pure pieces.

Most of what one engine step costs depends only on a few token counts: the GEMMs see
the (padded) tokens through a GPU, the MoE kernel the tokens its expert group routes,
the LM head the rows it samples. A replay meets the same counts over and over (a
decode batch of 4 requests pads to the same graph size every step), yet the cost
model would recompute them from scratch each time — some hundred small numpy calls
per step. The step model therefore asks this memo first.

Exactness, not approximation: the key is the pieces' exact inputs (dtype, shape and
bytes of every array, the value of every other argument), nothing is bucketed or
rounded, and a hit returns the very array computed the first time. So a replay with
the memo is the same, bit for bit, as one without it (`sim_step_cache=False`), which
`tests/engine/test_step_memo.py` checks. Cached arrays are shared: callers must never
write into them (the step model only builds new arrays from them).

A fast-forwarded run asks for k steps at once, (k, ranks) arrays whose rows differ
only in the contexts; the token counts the pieces see are the same in every row. Keyed
on the whole arrays, every run length would be a new entry; `same_rows` spots such
inputs, so the piece is computed (and remembered) for one row, and the caller lets
numpy broadcast that row against the run's other (k, ranks) arrays — the same values,
as every piece treats steps independently.
"""

from __future__ import annotations

import numpy as np

_NUMPY = (np.ndarray, np.generic)  # arrays and numpy scalars: keyed with their dtype
MAX_ENTRIES = 1 << 16  # a few MB; a replay's distinct batch shapes number in the hundreds


class ExactMemo:
    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._store: dict = {}
        self.hits = 0
        self.misses = 0

    def __call__(self, name: str, fn, args: tuple):
        """fn(*args), a pure function of `args`, evaluated once per distinct exact value
        of them (`name` tells the pieces apart)."""
        # the key inline (a step asks some ten pieces: a helper call per argument shows)
        key = (name, *[(x.dtype, x.shape, x.tobytes()) if isinstance(x, _NUMPY) else x
                       for x in args])  # (dtypes compare and hash by value)
        found = self._store.get(key)
        if found is not None:
            self.hits += 1
            return found
        self.misses += 1
        if len(self._store) >= self.max_entries:  # bounded memory: start over
            self._store.clear()
        value = self._store[key] = fn(*args)
        return value


def no_memo(name: str, fn, args: tuple):
    """The memo switched off (`sim_step_cache=False`): always compute."""
    return fn(*args)


def same_rows(arrays) -> bool:
    """Are all rows of each (k, n) array the same, byte for byte? (One memcmp each,
    where an elementwise == and its reduction would be two numpy calls; -0.0 and 0.0
    count as different, which only means a piece is priced on the whole array.)"""
    for a in arrays:
        k = a.shape[0]
        if k > 1 and a.tobytes() != a[:1].tobytes() * k:
            return False
    return True
