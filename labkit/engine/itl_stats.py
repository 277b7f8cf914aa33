"""Inter-token latencies (ITL) of many requests, read once for the tables.

Each request keeps its ITL as a list of floats, one per emission after the first
token (`Request.itl`). The requests table wants, per request, their mean, P50, P90 and
maximum; the summary wants all of them, in one array. `ITLSamples` turns the lists
into that one array once and hands out each request's statistics from it.

A replay of 600 s holds about 1.6M ITLs over 2K requests: one `np.percentile` call
per request (about 100 µs of set-up each) was most of the table's cost. The
percentiles here are numpy's default ('linear') taken from a sorted copy of the
request's ITLs, computed step by step as `np.percentile` computes them, so they equal
its results bit for bit (a test compares them on many samples).
"""

from __future__ import annotations

import math
from itertools import chain

import numpy as np


class ITLSamples:
    """Every request's ITLs, one request after another, in one float64 array."""

    def __init__(self, requests: list) -> None:
        counts = [len(r.itl) for r in requests]
        self.values = np.fromiter(chain.from_iterable(r.itl for r in requests), float,
                                  count=sum(counts))
        self._bounds = np.concatenate(([0], np.cumsum(counts, dtype=np.int64))).tolist()
        self._counts = counts

    def of(self, i: int) -> np.ndarray:
        """Request i's ITLs (a view)."""
        return self.values[self._bounds[i]:self._bounds[i + 1]]

    def where(self, keep: list[bool]) -> np.ndarray:
        """The ITLs of the requests kept, one after another."""
        return self.values[np.repeat(np.asarray(keep, dtype=bool), self._counts)]

    def stats(self, i: int) -> tuple[float, float, float, float]:
        """Request i's ITL mean, P50, P90 and maximum (NaN when it has none), as
        `itl.mean()`, `np.percentile(itl, (50, 90))` and `itl.max()` give them."""
        itl = self.of(i)
        if not len(itl):
            return math.nan, math.nan, math.nan, math.nan
        ordered = np.sort(itl)
        low, high = float(ordered[0]), float(ordered[-1])
        if not (math.isfinite(low) and math.isfinite(high)):  # numpy's own rules then
            p50, p90 = np.percentile(itl, (50, 90))
        else:
            p50, p90 = _linear(ordered, 0.5), _linear(ordered, 0.9)
        return itl.mean(), p50, p90, high


def _linear(ordered: np.ndarray, q: float) -> float:
    """The q-quantile (0 <= q <= 1) of sorted, finite values by linear interpolation,
    in numpy's steps: virtual index (n - 1) * q, the two neighbours, and the
    interpolation from the nearer end (`np.percentile`'s `_lerp`)."""
    n = len(ordered)
    index = (n - 1) * q
    if index >= n - 1:
        return float(ordered[-1])
    below = math.floor(index)
    gamma = index - below
    a, b = float(ordered[below]), float(ordered[below + 1])
    diff = b - a
    return b - diff * (1 - gamma) if gamma >= 0.5 else a + diff * gamma
