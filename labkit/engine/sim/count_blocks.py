"""Count blocks: a step's count pieces priced for a block of prefill sizes at once.

What a step's token counts alone decide — the GEMMs, the MoE kernel, graph dispatch,
the CPU's share (`LayerStepModel._count_pieces`) — is remembered per distinct counts
(`memo.py`). Decode steps repeat their counts all the time; a step that carries a
prompt's chunk rarely does: its prefill size is what is left of that prompt, new for
almost every prompt, so each such step pays the pieces' ~250 small numpy calls (some
130 us) for one step.

The cost model's contract is that element i of an array call equals the scalar call on
element i, bit for bit (`costmodel/model.py`). So on such a miss the pieces are priced
once for `BLOCK` consecutive prefill sizes around the step's, the other counts the
same, as one (BLOCK, 1) array — the same calls, a few hundred elements each — and the
step reads its row; later prompts whose chunk falls in the block read theirs. A replay
meets a few dozen blocks where it met a couple of thousand new counts. The compiled
rows (`compiled_rows.py`) read a block as one table of numbers, a row per size.

It takes steps of one rank (numbers, not lockstep) on one pipeline stage whose prefill
size is an integer; and models without a routing curve (the busiest EP rank's factor
interpolates on log2, a transcendental numpy need not round alike for arrays and
numbers). `tests/engine/test_compiled_rows.py` checks rows against the numbers' pieces.
"""

from __future__ import annotations

import numpy as np

from labkit.engine.sim.memo import MAX_ENTRIES

BLOCK = 512  # prefill sizes per block
_INT, _BOOL = np.int64, np.bool_
_UNMADE = object()  # a block's numbers not asked for yet


class CountBlocks:
    def __init__(self, model) -> None:
        """`model`: a `LayerStepModel` for which `applies(model)` holds."""
        self.model = model
        # (start, other counts as ints) -> [the block's pieces, row reader, numbers]
        self._blocks: dict = {}

    @staticmethod
    def applies(model) -> bool:
        return model.layout.pp == 1 and model.mlp.moe_curve is None

    @staticmethod
    def takes(lockstep: bool, counts) -> bool:
        """Are these a step's counts that a block prices: one rank's numbers (int64
        token and request counts, a bool idle), with a prefill chunk?"""
        prefill, decode, prefills, decodes, idle = counts
        return (not lockstep and type(prefill) is _INT and prefill > 0 and type(decode) is _INT
                and type(prefills) is _INT and type(decodes) is _INT and type(idle) is _BOOL)

    def pieces(self, *counts):
        """The count pieces of the step with these counts (`takes`), read off its
        block."""
        entry, i = self._entry(counts)
        if entry[1] is None:
            entry[1] = _reader(entry[0])
        return entry[1](i)

    def numbers(self, counts, table):
        """`table(pieces, BLOCK)` of the step's block — a (BLOCK, fields) array, or
        None — made once per block; the step's row of it, (1, fields), or None."""
        entry, i = self._entry(counts)
        if entry[2] is _UNMADE:
            entry[2] = table(entry[0], BLOCK)
        return None if entry[2] is None else entry[2][i : i + 1]

    def _entry(self, counts):
        """(the block of the step with these counts, the step's row in it)."""
        prefill = int(counts[0])
        start = prefill - prefill % BLOCK
        # (the counts' types are fixed by `takes`: their ints key them exactly)
        key = (start, *[int(x) for x in counts[1:]])
        entry = self._blocks.get(key)
        if entry is None:
            if len(self._blocks) >= MAX_ENTRIES:
                self._blocks.clear()
            entry = self._blocks[key] = [self._block(start, *counts[1:]), None, _UNMADE]
        return entry, prefill - start

    def _block(self, start: int, *others):
        """The count pieces of BLOCK steps, prefill sizes start, start + 1, ...,
        the other counts `others` in each."""
        sizes = np.arange(start, start + BLOCK, dtype=_INT).reshape(-1, 1)
        columns = [np.full((BLOCK, 1), x, dtype=x.dtype) for x in others]
        return self.model._count_pieces(False, sizes, *columns)


def _reader(pieces):
    """i -> row i of a block's pieces: each (BLOCK, 1) array's element i (a numpy
    number, as the step's own numbers give), what no count changes (numbers, None) as
    it is; tuples, named or not, piece by piece."""
    if type(pieces) is np.ndarray and pieces.ndim == 2:
        return pieces[:, 0].__getitem__
    if isinstance(pieces, tuple):
        parts = [_reader(x) for x in pieces]
        make = type(pieces)._make if hasattr(pieces, "_fields") else tuple
        return lambda i: make([part(i) for part in parts])
    return lambda i: pieces
