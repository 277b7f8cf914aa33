"""Rows of a trace chosen by their values: ``--where "Model=GPT-4"``.

Published traces mix traffic a study often wants apart: BurstGPT logs ChatGPT and
GPT-4 calls, conversations and API calls, and failed requests (``Response tokens`` 0)
side by side -- vLLM's BurstGPT loader keeps ``Model == "GPT-4"`` with ``Response
tokens > 0``; Qwen-Bailian tags each turn text, search, image or file. A filter is a
list of conditions, all of which a row must meet, each ``NAME OP VALUE`` on a CSV
column or a JSON line's field:

* ``=`` (or ``==``) and ``!=``: the value equals VALUE as text (a CSV cell stripped, a
  JSON string as it is, any other JSON value as JSON spells it), or -- where VALUE is a
  number -- the value is a number equal to it (``0`` matches ``0.0``);
* ``>``, ``>=``, ``<``, ``<=``: VALUE must be a number, and so must the value.

A filtered file is read **as if it held only the rows that match**: the others are
not checked, make no request and count for nothing (Azure's clock starts at the first
kept row; a BurstGPT session chains its kept rows; a Bailian turn whose parent is
dropped starts a conversation, as one whose parent is outside the file does). Kept
rows keep their names (the file line, the chat id). Conditions are tried in order and
stop at the first a row fails, so a numeric condition after ``Model=GPT-4`` never reads
other models' rows. A value a numeric condition cannot read is a TraceError naming
its line, and so is a name the CSV header (or a JSON line) lacks; a filter no row
meets is a ConfigError. The formats whose calls are flat rows take a filter (the CSV
ones, Mooncake, Bailian); labkit and AgentX files, whose calls hang together in
sessions and trace objects, do not.
"""
from __future__ import annotations

import json
import math
import operator
from dataclasses import dataclass

import numpy as np

from labkit.errors import ConfigError
from labkit.traces.validate import TraceError

# the first in the text, the longest of those starting there (">=" is not ">" then "=5")
OPERATORS = ("==", "!=", ">=", "<=", "=", ">", "<")
USAGE = "give NAME=VALUE, NAME!=VALUE or NAME>NUMBER (also >=, <, <=), NAME a column or field"
# (elementwise on arrays, plain on one cell)
_COMPARE = {"=": operator.eq, "!=": operator.ne, ">": operator.gt, ">=": operator.ge,
            "<": operator.lt, "<=": operator.le}


@dataclass(frozen=True, slots=True)
class Condition:
    column: str
    op: str  # one of OPERATORS, "==" spelt "="
    value: str
    number: float | None  # VALUE as a number, where it is one

    def __str__(self) -> str:
        return f"{self.column}{self.op}{self.value}"

    def holds(self, cells):
        """For one cell or elementwise: cells as text where VALUE is text, as numbers
        where it is a number."""
        return _COMPARE[self.op](cells, self.value if self.number is None else self.number)


def parse_condition(text: str) -> Condition:
    """``"Response tokens>0"`` -> Condition; ConfigError saying how to spell one."""
    if not isinstance(text, str):
        raise ConfigError(f"--where {text!r}: {USAGE}")
    at = min(((text.find(op), -len(op), op) for op in OPERATORS if op in text), default=None)
    if at is None:
        raise ConfigError(f"--where {text!r}: no comparison; {USAGE}")
    start, _, op = at
    column, value = text[:start].strip(), text[start + len(op):].strip()
    if not column or not value:
        raise ConfigError(f"--where {text!r}: a name and a value are needed; {USAGE}")
    number = _number(value)
    if op in (">", ">=", "<", "<=") and number is None:
        raise ConfigError(f"--where {text!r}: {op} compares numbers, and {value!r} is not one")
    return Condition(column, "=" if op == "==" else op, value, number)


def _number(text) -> float | None:
    """A finite number from a cell's text (or a JSON number), or None."""
    try:
        value = float(text)
    except (ValueError, OverflowError):
        return None
    return value if math.isfinite(value) else None


class RowFilter:
    """The conditions of one load, and what they kept (``seen`` rows, ``kept_rows``)."""

    def __init__(self, conditions: list[Condition]) -> None:
        self.conditions = conditions
        self.seen = self.kept_rows = 0

    @classmethod
    def parse(cls, where) -> RowFilter | None:
        """From a condition's text or a list of them (None or empty: no filter; a
        RowFilter: itself)."""
        if where is None or isinstance(where, RowFilter):
            return where
        texts = [where] if isinstance(where, str) else list(where)
        return cls([parse_condition(t) for t in texts]) if texts else None

    def __str__(self) -> str:
        return " and ".join(repr(str(c)) for c in self.conditions)

    @property
    def columns(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(c.column for c in self.conditions))

    def missing(self, header: list[str], path: str) -> None:
        """TraceError (line 1) if a condition names a column the header lacks."""
        absent = [c for c in self.columns if c not in header]
        if absent:
            raise TraceError(path, 1, f"--where names column(s) {', '.join(map(repr, absent))}"
                                      f"; the header has {', '.join(map(repr, header))}")

    def kept(self, rows, path: str):
        """The ``(line, row)`` pairs of ``rows`` that meet every condition; then, if
        there were rows and none did, the ConfigError saying so."""
        self.seen = self.kept_rows = 0
        for line, row in rows:
            if self.accepts(row, path, line):
                yield line, row
        if self.seen and not self.kept_rows:
            raise self.nothing_kept(path)

    def accepts(self, row: dict, path: str, line: int) -> bool:
        """Does this row meet every condition? Its values are a CSV row's stripped
        cells, or a JSON line's values (text conditions read a non-string as its JSON
        spelling). TraceError for a value a numeric condition cannot read, or a JSON
        line without the field."""
        self.seen += 1
        for c in self.conditions:
            if c.column not in row:  # (a CSV header lacking it is refused first)
                raise TraceError(path, line, f"no field {c.column!r} (--where {str(c)!r}); "
                                             f"the line has {', '.join(map(repr, row))}")
            value = row[c.column]
            if c.number is not None:
                cell = None if isinstance(value, bool) or not isinstance(
                    value, (str, int, float)) else _number(value)
                if cell is None:
                    raise TraceError(path, line, f"{c.column!r}: {value!r} is not a number "
                                                 f"(--where {str(c)!r})")
            else:
                cell = value if isinstance(value, str) else json.dumps(value)
            if not c.holds(cell):
                return False
        self.kept_rows += 1
        return True

    def mask(self, cells: dict[str, list[str]]) -> np.ndarray | None:
        """The rows meeting every condition, from whole columns of stripped cells (the
        column reader's way), or None where a numeric condition meets a cell that is
        not a number in a row the conditions before it kept (the row reader names it)."""
        n = len(next(iter(cells.values())))
        alive = np.ones(n, dtype=bool)
        for c in self.conditions:
            rows = np.flatnonzero(alive)
            if len(rows) == 0:
                break
            texts = [cells[c.column][i].strip() for i in rows.tolist()]
            if c.number is None:
                values = np.array(texts)
            else:
                numbers = [_number(t) for t in texts]
                if None in numbers:
                    return None
                values = np.array(numbers, dtype=np.float64)
            alive[rows[~c.holds(values)]] = False
        self.seen, self.kept_rows = n, int(alive.sum())
        return alive

    def nothing_kept(self, path: str) -> ConfigError:
        """The error of a filter no row of the file meets."""
        return ConfigError(f"--where {self}: none of the {self.seen} rows of {path} match")
