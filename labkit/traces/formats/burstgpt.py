"""BurstGPT traces: bursty ChatGPT / GPT-4 traffic, token counts only.

BurstGPT (``HPMLL/BurstGPT``) logged four months of an Azure OpenAI GPT service as
CSV::

    Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
    5,ChatGPT,472,18,490,Conversation log

``Timestamp`` is the submission time in seconds from midnight of the first day;
``Log Type`` says whether a user chatted or called the API. Failed requests have
``Response tokens`` 0 (the ``..._without_fails`` files drop them); we keep them as
one-token requests (``common.py``). ``where=["Model=GPT-4", "Response tokens>0"]``
(``--where``, `row_filter.py`) reads the rows vLLM's BurstGPT benchmark load keeps.
Newer releases add a ``Session ID`` column: when it is there, the rows of one session
become one labkit session -- each request's parent is the session's previous request,
``delay_s`` the gap between their arrivals. Without it (or with an empty cell) every
row is a session of its own.

There is no prompt content, so each prompt gets fresh block ids: whether a turn's
request tokens include the conversation so far is not published, and we do not
invent prefix reuse. Requests keep their timestamps (open loop replays them).
"""
from __future__ import annotations

import numpy as np

from labkit.traces.formats import csv_columns as columns
from labkit.traces.formats.common import FreshIds, csv_rows, float_cell, int_cell
from labkit.traces.formats.row_filter import RowFilter
from labkit.traces.schema import Trace, TraceRequest

BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")
SESSION_COLUMN = "Session ID"


def load_burstgpt(path: str, window: tuple[float, float] | None = None,
                  where: RowFilter | None = None) -> Trace:
    """Read a BurstGPT CSV (TraceError names the first bad line); ``window``: the
    sessions starting in it may be all that is loaded (`csv_columns.in_window`);
    ``where``: only the rows it accepts (`row_filter.py`)."""
    fresh = FreshIds()
    requests = _by_columns(path, fresh, window, where)
    if requests is not None:
        return fresh.trace(requests, path, "burstgpt")
    requests: list[TraceRequest] = []
    last_of_session: dict[str, TraceRequest] = {}
    for line, row in csv_rows(path, BURSTGPT_COLUMNS, "BurstGPT", where):
        stamp = float_cell(row, "Timestamp", path, line)
        session = row.get(SESSION_COLUMN, "")
        before = last_of_session.get(session) if session else None
        req = fresh.request(
            (path, line), f"bg-{line}", int_cell(row, "Request tokens", path, line),
            int_cell(row, "Response tokens", path, line), timestamp=stamp,
            session_id=f"bg-s{session}" if session else None,
            parent_id=before.request_id if before else None,
            delay_s=max(stamp - before.timestamp, 0.0) if before else 0.0)
        requests.append(req)
        if session:
            last_of_session[session] = req
    return fresh.trace(requests, path, "burstgpt")


def _by_columns(path: str, fresh: FreshIds, window: tuple[float, float] | None = None,
                where: RowFilter | None = None) -> list[TraceRequest] | None:
    """The rows read a column at a time (``csv_columns``), or None."""
    read = columns.timed_counts(path, BURSTGPT_COLUMNS, (SESSION_COLUMN,), where)
    if read is None:
        return None
    cells, lines, stamps, inputs, outputs = read
    names = [f"bg-{line}" for line in lines.tolist()]
    if SESSION_COLUMN not in cells:
        return fresh.many(names, inputs, outputs, stamps,
                          keep=columns.in_window(stamps, window))
    sessions, parents = [], []
    delays = np.zeros(len(stamps))
    last_of_session: dict[str, int] = {}  # session -> its latest row so far
    for i, session in enumerate(columns.strings(cells[SESSION_COLUMN])):
        before = last_of_session.get(session) if session else None
        sessions.append(f"bg-s{session}" if session else None)
        parents.append(names[before] if before is not None else None)
        if before is not None:
            delays[i] = max(stamps[i] - stamps[before], 0.0)
        if session:
            last_of_session[session] = i
    return fresh.many(names, inputs, outputs, stamps, sessions, parents, delays,
                      keep=columns.in_window(stamps, window, sessions))
