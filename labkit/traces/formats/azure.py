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

from datetime import datetime, timezone

from labkit.traces.formats.common import FreshIds, csv_rows, int_cell
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


def load_azure(path: str) -> Trace:
    """Read an Azure LLM inference CSV (TraceError names the first bad line)."""
    fresh = FreshIds()
    requests: list[TraceRequest] = []
    stamps: list[datetime] = []
    for line, row in csv_rows(path, AZURE_COLUMNS, "Azure"):
        stamps.append(_when(row["TIMESTAMP"], path, line))
        requests.append(fresh.request(
            (path, line), f"az-{line}", int_cell(row, "ContextTokens", path, line),
            int_cell(row, "GeneratedTokens", path, line), timestamp=0.0))
    start = min(stamps, default=None)
    for req, stamp in zip(requests, stamps, strict=True):
        req.timestamp = (stamp - start).total_seconds()  # exact to the microsecond
    return fresh.trace(requests, path, "azure")
