"""Mooncake traces: open-loop arrivals with prefix hashes.

Mooncake (kvcache-ai, FAST'25) published JSONL traces with one request per line::

    {"timestamp": 277, "input_length": 32140, "output_length": 92, "hash_ids": [198, ...]}

``timestamp`` is the arrival time in milliseconds from the start of the trace;
``hash_ids`` has one id per 512-token block of the prompt (the last may be
partial). There are no sessions or parent links: requests arrive on their own
clock (open loop), and multi-turn reuse shows up only as shared leading ids.

We load each line as its own single-call session: ``session_id = request_id =
"mc-<line number>"``, kind "main", no parent, delay 0, ``timestamp`` in seconds.
"""
from __future__ import annotations

from labkit.traces.jsonl import FieldSpec, check_fields, id_array, read_objects
from labkit.traces.schema import Trace, TraceRequest
from labkit.traces.validate import TraceError, check_request

MOONCAKE_BLOCK_SIZE = 512

MOONCAKE_FIELDS: FieldSpec = {  # name: (JSON type, required, nullable)
    "timestamp": ("number", True, False),
    "input_length": ("integer", True, False),
    "output_length": ("integer", True, False),
    "hash_ids": ("list of integers", True, False),
}


def load_mooncake(path: str) -> Trace:
    """Read a Mooncake JSONL trace (raises TraceError on the first bad line)."""
    requests: list[TraceRequest] = []
    for line_no, obj in read_objects(path):
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
    if not requests:
        raise TraceError(path, 1, "empty trace: no requests")
    return Trace(MOONCAKE_BLOCK_SIZE, requests, source=path, format="mooncake")
