"""The few shapes every op's time is built from.

A kernel is limited by whichever resource it exhausts first: tensor-core FLOPs, HBM
bytes, or the fixed cost of the work units it hands to SMs. Near the crossover two
limits overlap imperfectly, so instead of a hard `max` the ops combine them as a
*smooth maximum*, the Euclidean norm sqrt(a^2 + b^2 + ...): equal to the larger term
when one dominates, 41 % above it when two are equal (the measured kernels sit between
max and sum there). A fixed launch latency is added on top.

Bit-exactness: the engine evaluates thousands of steps as one numpy array and expects
element i to equal a scalar call with element i's inputs, bit for bit. numpy's
transcendental functions (exp, log, pow) may take different SIMD code paths for arrays
and scalars, so nothing in this package uses them: only + - * /, sqrt (correctly
rounded by IEEE 754), floor/ceil, minimum/maximum and where.
"""

from __future__ import annotations

import sys

import numpy as np
from numba.extending import register_jitable

from labkit.errors import ConfigError


_INF = float("inf")
_NUMBERS = (int, float, np.generic)


def as_array(x):
    """Numeric shape argument as float64 (ints stay exact below 2**53), checked: sizes,
    counts and degrees are finite and >= 0 (a negative one would price a negative
    time)."""
    if type(x) is int or type(x) is float:  # the common scalar: a cheap check
        ok = 0 <= x < _INF
    elif type(x) is np.ndarray and x.size == 1:  # one element: the same check, no reductions
        x = np.asarray(x, dtype=np.float64)
        ok = 0 <= x.item() < _INF
    else:
        x = np.asarray(x, dtype=np.float64)
        ok = x.size == 0 or 0 <= x.min() and x.max() < _INF  # (NaN fails both)
    if not ok:
        op = sys._getframe(1).f_code.co_name  # the CostModel method (only on this path)
        raise ConfigError(f"CostModel.{op}: sizes must be finite numbers >= 0, got {x!r}")
    return as_float(x)


def as_float(x):
    """Numeric shape argument as float64, unchecked: an array as a float64 array, a
    number (Python or numpy, or a 0-d array) as a numpy float64 scalar — the same IEEE
    arithmetic as a 0-d array, at a tenth of the cost per operation."""
    if isinstance(x, _NUMBERS) or (type(x) is np.ndarray and x.ndim == 0):
        return np.float64(x)
    return np.asarray(x, dtype=np.float64)


def result(seconds: np.ndarray):
    """Scalars in, a Python float out; arrays in, an array out."""
    seconds = np.asarray(seconds, dtype=np.float64)
    return float(seconds) if seconds.ndim == 0 else seconds


@register_jitable  # (a plain function; compiled code may call it too)
def smooth_max(*terms: np.ndarray) -> np.ndarray:
    """sqrt(sum of squares): the larger term when one dominates, softer at the crossover."""
    total = terms[0] * terms[0]
    for t in terms[1:]:
        total = total + t * t
    return np.sqrt(total)


def sharp_max(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(a^4 + b^4)^(1/4): like `smooth_max` but only 19 % above the larger of two equal
    terms, for kernels that overlap memory and compute well (software-pipelined)."""
    a2, b2 = a * a, b * b
    return np.sqrt(np.sqrt(a2 * a2 + b2 * b2))


def ceil_div(a: np.ndarray, b) -> np.ndarray:
    """How many units of size b cover a (tiles, waves)."""
    return np.ceil(a / b)


@register_jitable  # (a plain function; compiled code may call it too)
def causal_pairs(new_tokens: np.ndarray, prefix: np.ndarray) -> np.ndarray:
    """(query, key) pairs one sequence attends in a causal prefill of `new_tokens` after
    `prefix` cached tokens: every new token sees the prefix and the new tokens up to
    itself."""
    return new_tokens * prefix + new_tokens * (new_tokens + 1.0) * 0.5
