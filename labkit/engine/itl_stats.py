"""Inter-token latencies (ITL): how requests record them, and how the tables read them.

Each request records one gap per emission after its first token (`Request.itl`, a
`TokenGaps`). A step emits one gap per request; a fast-forwarded run emits, for every
request in it, the gap to its first step's end and then the run's step gaps — the same
array for all of them, which `TokenGaps` holds by reference: a replay of 600 s has
about 1.6M gaps, most from runs, and holding them as Python floats cost a float object
and a list slot each (~50 MB) and a conversion per request and run.

The requests table wants, per request, their mean, P50, P90 and maximum; the summary
wants all of them, in one array. `ITLSamples` lays the gaps out as that one array once
and hands out each request's statistics from it: one `np.percentile` call per request
(about 100 µs of set-up each) was most of the table's cost. The
percentiles here are numpy's default ('linear') taken from a sorted copy of the
request's ITLs, computed step by step as `np.percentile` computes them, so they equal
its results bit for bit (a test compares them on many samples).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit


class TokenGaps:
    """One request's gaps between successive token emissions, in order: single gaps
    (`append`) and runs of them (`extend`; an array is kept as it is, so it must not
    change afterwards — a run's gaps are read-only)."""

    __slots__ = ("_pieces", "_n", "_runs")

    def __init__(self) -> None:
        self._pieces: list = []  # floats and arrays of floats, in order
        self._n = 0
        self._runs = 0  # how many of the pieces are arrays

    def append(self, gap: float) -> None:
        self._pieces.append(gap)
        self._n += 1

    def extend(self, gaps) -> None:
        gaps = gaps if isinstance(gaps, np.ndarray) else np.asarray(gaps, dtype=float)
        if len(gaps):
            self._pieces.append(gaps)
            self._n += len(gaps)
            self._runs += 1

    def __len__(self) -> int:
        return self._n

    def values(self) -> np.ndarray:
        """The gaps, as one float64 array (a copy)."""
        out = np.empty(self._n)
        self.lay_out(out, 0)
        return out

    def lay_out(self, out: np.ndarray, at: int) -> int:
        """Write the gaps into `out` from index `at`; returns where they end."""
        if not self._runs:  # single gaps alone (a request that ran step by step)
            out[at : at + self._n] = self._pieces
            return at + self._n
        for p in self._pieces:
            if isinstance(p, np.ndarray):
                out[at : at + len(p)] = p
                at += len(p)
            else:
                out[at] = p
                at += 1
        return at

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        values = self.values()
        return values if dtype is None else values.astype(dtype)

    def __iter__(self):
        return iter(self.values().tolist())

    def __repr__(self) -> str:
        return f"TokenGaps({self.values().tolist()})"


class ITLSamples:
    """Every request's ITLs, one request after another, in one float64 array."""

    def __init__(self, requests: list) -> None:
        counts = [len(r.itl) for r in requests]
        self.values = np.empty(sum(counts))
        at = 0
        for r in requests:
            at = r.itl.lay_out(self.values, at)
        self._bounds = np.concatenate(([0], np.cumsum(counts, dtype=np.int64))).tolist()
        self._counts = counts

    def of(self, i: int) -> np.ndarray:
        """Request i's ITLs (a view)."""
        return self.values[self._bounds[i]:self._bounds[i + 1]]

    def where(self, keep: list[bool]) -> np.ndarray:
        """The ITLs of the requests kept, one after another: each run of consecutive
        requests kept is one slice of the values (no mask over every sample)."""
        kept = np.concatenate(([0], np.asarray(keep, dtype=np.int8), [0]))
        edges = np.flatnonzero(np.diff(kept)).tolist()  # where each run starts and ends
        bounds = self._bounds
        runs = [self.values[bounds[a]:bounds[b]] for a, b in zip(edges[0::2], edges[1::2])]
        return np.concatenate(runs) if runs else np.empty(0)

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

    def all_stats(self) -> tuple[list, list, list, list]:
        """Every request's `stats`, as four lists (means, P50s, P90s, maxima). The means
        come from one compiled pass (`_segment_means`); each request's sort stays
        numpy's (faster than a compiled one). A request whose ITLs include a value that
        is not finite is left to `stats` (numpy's percentile rules for infinities and
        NaNs)."""
        means, finite = _segment_means(self.values, np.asarray(self._bounds, dtype=np.int64))
        means, finite = means.tolist(), finite.tolist()
        nan = math.nan
        p50, p90, high = [nan] * len(means), [nan] * len(means), [nan] * len(means)
        for i, count in enumerate(self._counts):
            if not count:
                continue
            if not finite[i]:
                means[i], p50[i], p90[i], high[i] = self.stats(i)
                continue
            ordered = np.sort(self.of(i))
            p50[i], p90[i], high[i] = (_linear(ordered, 0.5), _linear(ordered, 0.9),
                                       float(ordered[-1]))
        return means, p50, p90, high


@njit(cache=True)
def _segment_means(values, bounds):
    """Per segment values[bounds[i]:bounds[i + 1]]: its mean as `ndarray.mean` gives it
    (NaN when empty), and whether all its values are finite."""
    n = len(bounds) - 1
    means = np.full(n, np.nan)
    finite = np.ones(n, dtype=np.bool_)
    for i in range(n):
        lo, count = bounds[i], bounds[i + 1] - bounds[i]
        if count:
            means[i] = (0.0 + _pairwise_sum(values, lo, count)) / count
            finite[i] = np.isfinite(values[lo : lo + count]).all()
    return means, finite


@njit(cache=True)
def _pairwise_sum(a, lo, n):
    """The sum of a[lo:lo + n] added as numpy adds a float64 array (`ndarray.mean`'s
    sum: from 0.0, eight running sums in blocks of up to 128 values, halves above
    that), so it equals numpy's bit for bit (a test compares them)."""
    if n < 8:
        res = 0.0
        for i in range(n):
            res += a[lo + i]
        return res
    if n <= 128:
        r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
        r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
        i = 8
        while i < n - (n % 8):
            r0 += a[lo + i]
            r1 += a[lo + i + 1]
            r2 += a[lo + i + 2]
            r3 += a[lo + i + 3]
            r4 += a[lo + i + 4]
            r5 += a[lo + i + 5]
            r6 += a[lo + i + 6]
            r7 += a[lo + i + 7]
            i += 8
        res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
        while i < n:
            res += a[lo + i]
            i += 1
        return res
    half = n // 2
    half -= half % 8
    return _pairwise_sum(a, lo, half) + _pairwise_sum(a, lo + half, n - half)


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
