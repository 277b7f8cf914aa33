"""Sessions as a replay sees them: when each agent task starts and ends.

A coding agent's user waits for the *task*, not for one call: the session-level
completion time runs from the arrival of its first call to the finish of its last
(tool gaps, subagents and queueing included). The trace feeder (``replay.py``) tells
a ``SessionLedger`` when it schedules a session's calls, when each call is released
to the engine, and when the session's last call finishes; ``frame()`` is then one
row per session:

==============  ==============================================================
session_id      as in requests.parquet (later epochs of a looped trace: ``@n``)
start_s         arrival of its first released call
end_s           finish of its last call (NaN while still running)
completion_s    end_s - start_s
calls           calls scheduled (part-way starts leave the earlier ones out)
part_way        started at a later turn (``start_part_way``): not a whole task
skipped_calls   calls skipped as oversized, or after a skipped call
finished        its last call finished before the run ended
==============  ==============================================================

Only *whole* tasks -- finished, not part-way, nothing skipped -- have a meaningful
completion time; ``slo.py`` summarises those. Runs driven by hand (``engine.submit``)
have no feeder: ``sessions_from_requests`` reads the same table off the requests.
"""
from __future__ import annotations

import math

import pandas as pd

SESSION_COLUMNS = ["session_id", "start_s", "end_s", "completion_s", "calls", "part_way",
                   "skipped_calls", "finished"]


class SessionLedger:
    """Records sessions as the feeder schedules, releases and finishes their calls."""

    def __init__(self) -> None:
        self._open: dict[str, dict] = {}   # session key -> row being filled
        self._rows: list[dict] = []

    def opened(self, key: str, session_id: str, calls: int, part_way: bool,
               skipped_calls: int) -> None:
        self._open[key] = {"session_id": session_id, "start_s": math.nan, "end_s": math.nan,
                           "calls": calls, "part_way": part_way,
                           "skipped_calls": skipped_calls, "finished": False}

    def released(self, key: str, at: float) -> None:
        row = self._open[key]
        if not at >= row["start_s"]:   # NaN (first release) or earlier
            row["start_s"] = at

    def closed(self, key: str, t: float) -> None:
        row = self._open.pop(key)
        row.update(end_s=t, finished=row["calls"] > 0)
        self._rows.append(row)

    def frame(self) -> pd.DataFrame:
        rows = self._rows + list(self._open.values())
        table = pd.DataFrame(rows, columns=[c for c in SESSION_COLUMNS if c != "completion_s"])
        table.insert(3, "completion_s", table["end_s"] - table["start_s"])
        return table.astype({"calls": int, "skipped_calls": int, "part_way": bool,
                             "finished": bool})


def sessions_from_requests(requests: pd.DataFrame) -> pd.DataFrame:
    """The session table of a run driven by hand: a session is its submitted calls,
    finished when all of them are."""
    if not len(requests):
        return pd.DataFrame(columns=SESSION_COLUMNS)
    grouped = requests.groupby("session_id", sort=False)
    table = pd.DataFrame({
        "start_s": grouped["arrival_s"].min(),
        "end_s": grouped["finish_s"].max(),
        "calls": grouped.size(),
        "finished": grouped["completed"].all(),
    }).reset_index()
    table.loc[~table["finished"], "end_s"] = math.nan
    table.insert(3, "completion_s", table["end_s"] - table["start_s"])
    table["part_way"] = False
    table["skipped_calls"] = 0
    return table[SESSION_COLUMNS]
