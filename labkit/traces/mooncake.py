"""Mooncake traces: open-loop arrivals with prefix hashes.

Mooncake (kvcache-ai, FAST'25) published JSONL traces with one request per line::

    {"timestamp": 277, "input_length": 32140, "output_length": 92, "hash_ids": [198, ...]}

``timestamp`` is the arrival time in milliseconds from the start of the trace;
``hash_ids`` has one id per 512-token block of the prompt (the last may be
partial). There are no sessions or parent links: requests arrive on their own
clock (open loop), and multi-turn reuse shows up only as shared leading ids.

We load each line as its own single-call session: ``session_id = request_id =
"mc-<line number>"``, kind "main", no parent, delay 0, ``timestamp`` in seconds.

Traces exported from other systems sometimes carry *absolute* Unix timestamps
instead (nanoseconds, microseconds, milliseconds or seconds since 1970). Read as
milliseconds from the start, a nanosecond stamp puts the run 1.7e15 s in, where a
float's spacing is a quarter of a second and every latency comes out as 0. The unit
is recognised by the size of the earliest stamp — no relative trace starts years in —
and such a trace is rebased to its first arrival (`EPOCH_UNITS`).
"""
from __future__ import annotations

from labkit.traces.jsonl import FieldSpec, check_fields, id_array, read_objects
from labkit.traces.schema import Trace, TraceRequest
from labkit.traces.validate import TraceError, check_request

MOONCAKE_BLOCK_SIZE = 512

# (smallest earliest stamp, stamps per second) of absolute Unix timestamps, by unit:
# a stamp at least this large is that unit since 1970 (1e9 s is 2001; as milliseconds
# from a trace's start it would be 11.6 days before its first request).
EPOCH_UNITS = ((10**17, 10**9), (10**14, 10**6), (10**11, 10**3), (10**9, 1))

MOONCAKE_FIELDS: FieldSpec = {  # name: (JSON type, required, nullable)
    "timestamp": ("number", True, False),
    "input_length": ("integer", True, False),
    "output_length": ("integer", True, False),
    "hash_ids": ("list of integers", True, False),
}


def load_mooncake(path: str, where=None) -> Trace:
    """Read a Mooncake JSONL trace (raises TraceError on the first bad line); ``where``:
    only the lines it accepts (a `formats.row_filter.RowFilter`)."""
    requests: list[TraceRequest] = []
    stamps: list[int | float] = []
    lines = read_objects(path)
    for line_no, obj in lines if where is None else where.kept(lines, path):
        check_fields(obj, MOONCAKE_FIELDS, path, line_no)
        rid = f"mc-{line_no}"
        req = TraceRequest(
            session_id=rid, request_id=rid, parent_id=None, kind="main", delay_s=0.0,
            input_length=obj["input_length"], output_length=obj["output_length"],
            hash_ids=id_array(obj["hash_ids"], path, line_no),
            timestamp=obj["timestamp"] / 1000.0)
        reason = check_request(req, MOONCAKE_BLOCK_SIZE)
        if reason:
            raise TraceError(path, line_no, reason)
        requests.append(req)
        stamps.append(obj["timestamp"])
    if not requests:
        raise TraceError(path, 1, "empty trace: no requests")
    _rebase_epoch_stamps(requests, stamps)
    return Trace(MOONCAKE_BLOCK_SIZE, requests, source=path, format="mooncake")


def _rebase_epoch_stamps(requests: list[TraceRequest], stamps: list) -> None:
    """Absolute Unix stamps (see the module doc) become seconds from the first
    arrival; the subtraction is done on the stamps as written (exact for integers)."""
    first = min(stamps)
    for threshold, per_second in EPOCH_UNITS:
        if first >= threshold:
            for req, stamp in zip(requests, stamps):
                req.timestamp = (stamp - first) / per_second
            return
