"""Azure LLM inference traces (2023 and 2024): arrivals and token counts.

Microsoft published samples of its LLM inference services' traffic
(``Azure/AzurePublicDataset``: ``AzureLLMInferenceTrace_{code,conv}.csv`` of 2023, the
data of the Splitwise paper; ``..._1week.csv`` of 2024, DynamoLLM's) as CSV::

    TIMESTAMP,ContextTokens,GeneratedTokens
    2023-11-16 18:17:03.9799600,4808,10

``TIMESTAMP`` is the invocation time -- naive with 7 fractional digits in 2023, with a
UTC offset in 2024 (``2024-05-10 00:00:00.009930+00:00``); both are read, naive
times as UTC. The prompts' content is not published, so there are no block ids and
no sessions: each row is its own single-call session ``az-<line>`` with fresh ids
(see ``common.py``), arriving at its timestamp in seconds from the trace's first.
"""
from __future__ import annotations

import re
from datetime import datetime, timezone

import numpy as np
import pandas as pd

from labkit.traces.formats import csv_columns as columns
from labkit.traces.formats.common import FreshIds, csv_rows, int_cell
from labkit.traces.formats.row_filter import RowFilter
from labkit.traces.schema import Trace, TraceRequest
from labkit.traces.validate import TraceError

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def _when(text: str, path: str, line: int) -> datetime:
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise TraceError(path, line, f"column 'TIMESTAMP': {text!r} is not a date and "
                                     f"time (like 2023-11-16 18:17:03.9799600)") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when


def load_azure(path: str, window: tuple[float, float] | None = None,
               where: RowFilter | None = None) -> Trace:
    """Read an Azure LLM inference CSV (TraceError names the first bad line);
    ``window``: the calls arriving in it may be all that is loaded (`csv_columns`);
    ``where``: only the rows it accepts (`row_filter.py`)."""
    fresh = FreshIds()
    requests = _by_columns(path, fresh, window, where)
    if requests is not None:
        return fresh.trace(requests, path, "azure")
    requests: list[TraceRequest] = []
    stamps: list[datetime] = []
    for line, row in csv_rows(path, AZURE_COLUMNS, "Azure", where):
        stamps.append(_when(row["TIMESTAMP"], path, line))
        requests.append(fresh.request(
            (path, line), f"az-{line}", int_cell(row, "ContextTokens", path, line),
            int_cell(row, "GeneratedTokens", path, line), timestamp=0.0))
    start = min(stamps, default=None)
    for req, stamp in zip(requests, stamps, strict=True):
        req.timestamp = (stamp - start).total_seconds()  # exact to the microsecond
    return fresh.trace(requests, path, "azure")


# The two published spellings (2023: naive, 7 digits; 2024: 6 digits and an offset),
# which datetime.fromisoformat and pandas read alike; anything else goes row by row.
_PUBLISHED_STAMP = re.compile(r"\d{4}-\d\d-\d\d ([01]\d|2[0-3]):[0-5]\d:[0-5]\d"
                              r"(\.\d{1,7})?([+-]([01]\d|2[0-3]):[0-5]\d)?")


def _by_columns(path: str, fresh: FreshIds, window: tuple[float, float] | None = None,
                where: RowFilter | None = None) -> list[TraceRequest] | None:
    """The rows read a column at a time (``csv_columns``), or None."""
    read = columns.plain_columns(path, AZURE_COLUMNS, where=where)
    if read is None:
        return None
    cells, lines = read
    inputs = columns.numbers(cells["ContextTokens"], whole=True)
    outputs = columns.numbers(cells["GeneratedTokens"], whole=True)
    texts = pd.Series(columns.strings(cells["TIMESTAMP"]))
    if inputs is None or outputs is None or not texts.str.fullmatch(_PUBLISHED_STAMP).all():
        return None
    try:
        stamps = pd.to_datetime(texts, format="ISO8601", utc=True)
    except (ValueError, OverflowError):
        return None
    micros = stamps.to_numpy(dtype="datetime64[ns]").view(np.int64) // 1000
    # fromisoformat keeps six digits of a second (the 2023 files give seven); the
    # differences between whole microseconds, then / 1e6, as timedelta.total_seconds()
    seconds = (micros - micros.min()) / 1e6
    return fresh.many([f"az-{line}" for line in lines.tolist()], inputs, outputs, seconds,
                      keep=columns.in_window(seconds, window))
