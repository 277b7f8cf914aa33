"""Checks of user-given values, each raising a `ConfigError` that names the knob.

A run that starts with `duration_s=nan` never ends; one with `warmup_s=-5` reports
nonsense; `concurrency=True` is an int to Python. Every value a user gives — an engine
knob, a replay argument, a CLI flag — passes one of these checks before anything
runs, so the mistake is reported in one line, with the knob's name as the user wrote
it (``--duration-s`` on the command line, ``duration_s`` in Python).
"""

from __future__ import annotations

import math
import numbers

from labkit.errors import ConfigError


def number(name: str, value, *, low: float | None = None, high: float | None = None,
           low_open: bool = False, none: bool = False) -> float | None:
    """A finite real number (not a bool) in [low, high] (`low_open`: (low, high]);
    None passes when `none`. Returns the value."""
    if value is None and none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name}={value!r} must be a number, not {type(value).__name__}")
    if not math.isfinite(value):
        raise ConfigError(f"{name}={value} must be a finite number")
    if low is not None and (value <= low if low_open else value < low):
        raise ConfigError(f"{name}={value} must be {'>' if low_open else '>='} {low}")
    if high is not None and value > high:
        raise ConfigError(f"{name}={value} must be <= {high}")
    return value


def integer(name: str, value, *, low: int | None = None, high: int | None = None,
            none: bool = False) -> int | None:
    """An int (not a bool, not a float) in [low, high]; None passes when `none`."""
    if value is None and none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{name}={value!r} must be an integer, not {type(value).__name__}")
    if low is not None and value < low:
        raise ConfigError(f"{name}={value} must be >= {low}")
    if high is not None and value > high:
        raise ConfigError(f"{name}={value:,} must be <= {high:,}")
    return int(value)


def flag(name: str) -> str:
    """How a knob is spelt on the command line: duration_s -> --duration-s."""
    return "--" + name.replace("_", "-")
