"""The two distributions benchmark loads are made of: arrivals and lengths.

**Arrivals** (``vllm bench serve --request-rate R --burstiness B``). Gaps between
requests are i.i.d. Gamma(shape=B, scale=1/(R*B)): mean 1/R whatever B, coefficient
of variation 1/sqrt(B). B = 1 is a Poisson process (exponential gaps); B < 1 is
burstier (clumps and lulls), B > 1 smoother, B = inf a constant gap 1/R; R = inf
sends everything at t = 0. As vLLM does, the first request also waits one gap, and
the cumulative times are rescaled so that the last of N requests arrives at exactly
N/R -- every seed then offers the same average rate, and only the shape of the gaps
is random.

**Lengths** (``--input-len L --range-ratio r``). Integer-uniform on
``[floor(L(1-r)), ceil(L(1+r))]`` (both ends included), r in [0, 1): r = 0 is a fixed
length. Output lengths are at least 1.

Both draw from a ``numpy.random.Generator`` the caller seeds: same seed, same load.
"""
from __future__ import annotations

import math

import numpy as np

from labkit.errors import ConfigError


def arrival_times(n: int, request_rate: float, burstiness: float,
                  rng: np.random.Generator) -> np.ndarray:
    """Arrival times (s, ascending) of ``n`` requests (see the module docstring)."""
    if n < 1:
        raise ConfigError(f"need at least one request, got {n}")
    if not request_rate > 0:
        raise ConfigError(f"request_rate={request_rate} must be > 0 (inf: all at once)")
    if not burstiness > 0:
        raise ConfigError(f"burstiness={burstiness} must be > 0 (1: Poisson)")
    if math.isinf(request_rate):
        return np.zeros(n)
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / request_rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    times = np.cumsum(gaps)
    if not times[-1] > 0:  # gaps below the smallest float: all at once, as rate = inf
        return np.zeros(n)
    return times * (n / request_rate / times[-1])


def length_bounds(mean: int, range_ratio: float, minimum: int = 0,
                  name: str = "length") -> tuple[int, int]:
    """The inclusive range lengths are drawn from (``name`` is the knob, for errors)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ConfigError(f"range_ratio={range_ratio} must be in [0, 1)")
    if not isinstance(mean, (int, np.integer)) or mean < minimum:
        raise ConfigError(f"{name}={mean!r} must be an integer >= {minimum}")
    return (max(math.floor(mean * (1 - range_ratio)), minimum),
            max(math.ceil(mean * (1 + range_ratio)), minimum))


def uniform_lengths(mean: int, range_ratio: float, n: int, rng: np.random.Generator,
                    minimum: int = 0, name: str = "length") -> np.ndarray:
    """``n`` integer-uniform lengths around ``mean`` (see the module docstring)."""
    low, high = length_bounds(mean, range_ratio, minimum, name)
    return rng.integers(low, high + 1, size=n)
