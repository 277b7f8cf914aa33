"""Splitwise traces: the request streams of the Splitwise simulator.

Splitwise (ISCA'24, ``Mutinifni/splitwise-sim``) replays request traces drawn from the
Azure 2023 token distributions at a chosen rate, as CSV::

    request_id,request_type,application_id,arrival_timestamp,batch_size,prompt_size,token_size
    0,2,0,0.0127,1,4808,10

``arrival_timestamp`` is in seconds; ``prompt_size`` / ``token_size`` are the prompt
and output tokens. Only those three columns are required. ``batch_size`` (1 in the
published generator) is read as that many identical requests arriving together.
Each request is a single-call session ``sw-<request_id>`` (the file line when there
is no ``request_id`` column) with fresh block ids: the format says nothing about
shared content.
"""
from __future__ import annotations

import numpy as np

from labkit.traces.formats import csv_columns as columns
from labkit.traces.formats.common import FreshIds, csv_rows, float_cell, int_cell
from labkit.traces.formats.row_filter import RowFilter
from labkit.traces.schema import Trace, TraceRequest
from labkit.traces.validate import TraceError

SPLITWISE_COLUMNS = ("arrival_timestamp", "prompt_size", "token_size")


def load_splitwise(path: str, window: tuple[float, float] | None = None,
                   where: RowFilter | None = None) -> Trace:
    """Read a Splitwise CSV trace (TraceError names the first bad line); ``window``:
    the calls arriving in it may be all that is loaded (`csv_columns.in_window`);
    ``where``: only the rows it accepts (`row_filter.py`)."""
    fresh = FreshIds()
    requests = _by_columns(path, fresh, window, where)
    if requests is not None:
        return fresh.trace(requests, path, "splitwise")
    requests: list[TraceRequest] = []
    line_of: dict[str, int] = {}
    for line, row in csv_rows(path, SPLITWISE_COLUMNS, "Splitwise", where):
        name = row.get("request_id") or str(line)
        if name in line_of:
            raise TraceError(path, line, f"duplicate request_id {name!r} (first at line "
                                         f"{line_of[name]})")
        line_of[name] = line
        copies = int_cell(row, "batch_size", path, line) if row.get("batch_size") else 1
        if copies < 1:
            raise TraceError(path, line, f"column 'batch_size': {copies} must be >= 1")
        for copy in range(copies):
            requests.append(fresh.request(
                (path, line), f"sw-{name}" if copies == 1 else f"sw-{name}.{copy}",
                int_cell(row, "prompt_size", path, line),
                int_cell(row, "token_size", path, line),
                timestamp=float_cell(row, "arrival_timestamp", path, line)))
    return fresh.trace(requests, path, "splitwise")


def _by_columns(path: str, fresh: FreshIds, window: tuple[float, float] | None = None,
                where: RowFilter | None = None) -> list[TraceRequest] | None:
    """The rows read a column at a time (``csv_columns``), or None."""
    read = columns.timed_counts(path, SPLITWISE_COLUMNS, ("request_id", "batch_size"), where)
    if read is None:
        return None
    cells, lines, stamps, inputs, outputs = read
    lines = lines.tolist()
    given = columns.strings(cells["request_id"]) if "request_id" in cells else [""] * len(lines)
    names = [name or str(line) for name, line in zip(given, lines, strict=True)]
    copies = np.ones(len(names), dtype=np.int64)
    if "batch_size" in cells:
        sizes = columns.strings(cells["batch_size"])
        given_sizes = [i for i, size in enumerate(sizes) if size]
        counts = columns.numbers([sizes[i] for i in given_sizes], whole=True)
        if counts is None or (counts < 1).any():
            return None
        copies[given_sizes] = counts
    if len(set(names)) != len(names):  # the row reader names the duplicate
        return None
    ids = [f"sw-{name}" if n == 1 else f"sw-{name}.{copy}"
           for name, n in zip(names, copies.tolist(), strict=True) for copy in range(n)]
    stamps = np.repeat(stamps, copies)
    return fresh.many(ids, np.repeat(inputs, copies), np.repeat(outputs, copies), stamps,
                      keep=columns.in_window(stamps, window))
