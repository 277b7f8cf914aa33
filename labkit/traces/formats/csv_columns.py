"""Plain CSV read a column at a time: the published token-count traces at their size.

BurstGPT holds 1.4M-5.3M rows, the 2024 Azure traces a week of traffic. Read row by
row (``common.csv_rows``: a dict per row, each cell checked on its own) they load at
some 17 us a row. Most such files are *plain*: no quotes, no blank or ragged rows,
one header -- and a plain file can be cut into columns with two string splits and
its numbers checked as arrays.

The rule that keeps both readers one reader: the column reader accepts a file only
where it would read every value exactly as the row reader does, and answers None
for anything else (quotes, carriage returns, blank or ragged rows, a repeated
column name, a value the row reader would refuse or one it reads in another way).
The format's loader then falls back to the row reader, which loads the file or
names its first bad line as before. Tests load the same files both ways.
"""
from __future__ import annotations

import contextlib
import zlib

import numpy as np
import pandas as pd

from labkit.traces.formats.row_filter import RowFilter
from labkit.traces.jsonl import open_text

# Whole numbers past this lose integer precision as floats: left to the row reader.
EXACT_INT = 2**53
_rows_only = False
CHUNK_ROWS = 1 << 16  # rows cut into cells at a time: only the wanted columns are kept


@contextlib.contextmanager
def rows_only():
    """Every CSV read row by row inside (``labkit bench traces`` times both ways)."""
    global _rows_only
    before, _rows_only = _rows_only, True
    try:
        yield
    finally:
        _rows_only = before


def plain_columns(path: str, wanted: tuple[str, ...], optional: tuple[str, ...] = (),
                  where: RowFilter | None = None):
    """``(cells, lines)`` of a plain CSV file with at least one data row: the cells
    (unstripped) of the ``wanted`` columns, and of the ``optional`` ones the header
    has, of the rows ``where`` accepts (all rows without it), and those rows' file
    lines (an array); None when the file is not plain or a cell ``where`` reads as a
    number is not one (ConfigError when ``where`` keeps no row)."""
    if _rows_only:
        return None
    try:
        with open_text(path) as f:
            text = f.read()
    except (OSError, UnicodeError, EOFError, zlib.error):  # the row reader names it
        return None
    if '"' in text or "\r" in text:
        return None
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    header = [c.strip() for c in lines[0].split(",")] if lines else []
    filtered = where.columns if where is not None else ()
    if len(lines) < 2 or len(set(header)) != len(header) or \
            any(c not in header for c in (*wanted, *filtered)):
        return None
    del text
    width = len(header)
    if any(line.count(",") != width - 1 for line in lines[1:]):  # blank or ragged rows
        return None
    names = tuple(dict.fromkeys((*wanted, *(c for c in optional if c in header), *filtered)))
    columns: dict[str, list[str]] = {name: [] for name in names}
    for first in range(1, len(lines), CHUNK_ROWS):  # (the cells of a chunk at a time)
        cells = ",".join(lines[first:first + CHUNK_ROWS]).split(",")
        for name in names:
            columns[name] += cells[header.index(name)::width]
    rows = np.arange(2, len(lines) + 1)
    if where is None:
        return columns, rows
    keep = where.mask(columns)
    if keep is None:
        return None
    if not keep.any():  # (as the row reader would find, at the end of the file)
        raise where.nothing_kept(path)
    kept = np.flatnonzero(keep).tolist()
    return {name: [cells[i] for i in kept] for name, cells in columns.items()}, rows[keep]


def numbers(cells: list[str], whole: bool = False) -> np.ndarray | None:
    """The cells as float64 as ``float()`` reads them (``whole``: as int64), or None
    when one is not a finite number (not a whole one) -- the row reader's refusals."""
    try:
        values = np.array([float(c) for c in cells], dtype=np.float64)
    except ValueError:
        return None
    if not np.isfinite(values).all():
        return None
    if whole:
        if not ((values == np.trunc(values)) & (np.abs(values) < EXACT_INT)).all():
            return None
        return values.astype(np.int64)
    return values


def timed_counts(path: str, wanted: tuple[str, str, str], optional: tuple[str, ...] = (),
                 where: RowFilter | None = None):
    """``(cells, lines, times, input tokens, output tokens)`` of a plain file whose
    ``wanted`` columns are (arrival time in seconds, input tokens, output tokens), as
    numbers (`plain_columns`); None when the file is not plain or a value is not read
    as a number."""
    read = plain_columns(path, wanted, optional, where)
    if read is None:
        return None
    cells, lines = read
    time, tokens_in, tokens_out = wanted
    values = (numbers(cells[time]), numbers(cells[tokens_in], whole=True),
              numbers(cells[tokens_out], whole=True))
    return None if any(v is None for v in values) else (cells, lines, *values)


def strings(cells: list[str]) -> list[str]:
    """Cells as the row reader gives them (stripped)."""
    return [c.strip() for c in cells]


def in_window(stamps: np.ndarray, window: tuple[float, float] | None,
              sessions: list[str | None] | None = None) -> np.ndarray | None:
    """The rows of the sessions whose earliest call arrives in ``window`` (a row of its
    own where its session is None), as a mask -- or None: no window, or none of the
    file's sessions starts in it (all are loaded then; ``parts.select`` says what the
    trace holds). Only a loader's shortcut: ``select`` applies the window after."""
    if window is None:
        return None
    earliest = stamps
    if sessions is not None and any(sessions):
        keys = [s if s is not None else i for i, s in enumerate(sessions)]
        earliest = pd.Series(stamps).groupby(keys, sort=False).transform("min").to_numpy()
    keep = (earliest >= window[0]) & (earliest < window[1])
    return keep if keep.any() else None
