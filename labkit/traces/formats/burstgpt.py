"""BurstGPT traces: bursty ChatGPT / GPT-4 traffic, token counts only.

BurstGPT (``HPMLL/BurstGPT``) logged four months of an Azure OpenAI GPT service as
CSV::

    Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
    5,ChatGPT,472,18,490,Conversation log

``Timestamp`` is the submission time in seconds from midnight of the first day;
``Log Type`` says whether a user chatted or called the API. Failed requests have
``Response tokens`` 0 (the ``..._without_fails`` files drop them); we keep them as
one-token requests (``common.py``). Newer releases add a ``Session ID`` column: when
it is there, the rows of one session become one labkit session -- each request's
parent is the session's previous request, ``delay_s`` the gap between their
arrivals. Without it (or with an empty cell) every row is a session of its own.

There is no prompt content, so each prompt gets fresh block ids: whether a turn's
request tokens include the conversation so far is not published, and we do not
invent prefix reuse. Requests keep their timestamps (open loop replays them).
"""
from __future__ import annotations

from labkit.traces.formats.common import FreshIds, csv_rows, float_cell, int_cell
from labkit.traces.schema import Trace, TraceRequest

BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")
SESSION_COLUMN = "Session ID"


def load_burstgpt(path: str) -> Trace:
    """Read a BurstGPT CSV (TraceError names the first bad line)."""
    fresh = FreshIds()
    requests: list[TraceRequest] = []
    last_of_session: dict[str, TraceRequest] = {}
    for line, row in csv_rows(path, BURSTGPT_COLUMNS, "BurstGPT"):
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
