"""Trace files: labkit's JSONL format, and ``load_trace`` for every format.

labkit JSONL is the schema written out: one request per line, keys exactly the
``TraceRequest`` fields (``hash_ids`` a JSON list; ``timestamp`` and ``priority``
optional) plus ``block_size``, repeated on every line so that each line stands on
its own (and must agree)::

    {"block_size":64,"session_id":"s00000","request_id":"s00000.m000",
     "parent_id":null,"kind":"main","delay_s":0.0,"input_length":31012,
     "output_length":377,"hash_ids":[0,1,2,...],"timestamp":null,"priority":0}

Loading validates everything before returning (see ``validate.py``); the first
problem raises ``TraceError("<path>:<line>: <reason>")``. Writing is atomic: we
write a temporary file next to the target and rename it over the target, so a
crash or an error never leaves a half-written trace behind.
"""
from __future__ import annotations

import gzip
import io
import json
import os
import tempfile
from pathlib import Path

from labkit.traces.id_lists import ids_json
from labkit.traces.jsonl import FieldSpec, check_fields, id_array, read_objects
from labkit.traces.schema import Trace, TraceRequest
from labkit.traces.validate import TraceError, check_links, check_request

LABKIT_FIELDS: FieldSpec = {  # name: (JSON type, required, nullable)
    "block_size": ("integer", True, False),
    "session_id": ("string", True, False),
    "request_id": ("string", True, False),
    "parent_id": ("string", True, True),
    "kind": ("string", True, False),
    "delay_s": ("number", True, False),
    "input_length": ("integer", True, False),
    "output_length": ("integer", True, False),
    "hash_ids": ("list of integers", True, False),
    "timestamp": ("number", False, True),
    "priority": ("integer", False, False),
}


def load_trace(path: str | os.PathLike, format: str = "auto", where=None) -> Trace:
    """Read a trace file. ``format``: "auto" (from the first line), or one of
    ``labkit.traces.formats.FORMATS`` (labkit, mooncake, bailian, azure, agentx,
    burstgpt, splitwise). ``where``: a CSV trace's rows to read, by their cells
    (``"Model=GPT-4"``, or a list of conditions all to be met: ``row_filter.py``).
    Raises TraceError on the first malformed line."""
    from labkit.traces.formats import load  # formats import this module's loader

    return load(path, format, where=where)


def load_labkit(path: str) -> Trace:
    requests: list[TraceRequest] = []
    lines: list[int] = []
    block_size: int | None = None
    first_line = 0
    line_error: TraceError | None = None
    try:
        for line_no, obj in read_objects(path):
            check_fields(obj, LABKIT_FIELDS, path, line_no)
            size = obj["block_size"]
            if size <= 0:
                raise TraceError(path, line_no, f"block_size must be > 0, got {size}")
            if block_size is None:
                block_size, first_line = size, line_no
            elif size != block_size:
                raise TraceError(path, line_no, f"block_size {size} differs from "
                                                f"{block_size} (line {first_line})")
            req = TraceRequest(
                session_id=obj["session_id"], request_id=obj["request_id"],
                parent_id=obj["parent_id"], kind=obj["kind"], delay_s=float(obj["delay_s"]),
                input_length=obj["input_length"], output_length=obj["output_length"],
                hash_ids=id_array(obj["hash_ids"], path, line_no),
                timestamp=None if obj.get("timestamp") is None else float(obj["timestamp"]),
                priority=obj.get("priority", 0))
            reason = check_request(req, block_size)
            if reason:
                raise TraceError(path, line_no, reason)
            requests.append(req)
            lines.append(line_no)
    except TraceError as e:
        line_error = e
    # A link error on an earlier line comes first; then the line error, if any.
    check_links(requests, path, lines)
    if line_error is not None:
        raise line_error
    if not requests:
        raise TraceError(path, 1, "empty trace: no requests")
    return Trace(block_size, requests, source=path, format="labkit")


def _line(req: TraceRequest, block_size: int) -> str:
    """The request as one JSON line (its ids spelt by `ids_json`, as json spells them)."""
    head = json.dumps({
        "block_size": block_size, "session_id": req.session_id,
        "request_id": req.request_id, "parent_id": req.parent_id, "kind": req.kind,
        "delay_s": float(req.delay_s), "input_length": int(req.input_length),
        "output_length": int(req.output_length), "hash_ids": None,
        "timestamp": None if req.timestamp is None else float(req.timestamp),
        "priority": int(req.priority),
    }, separators=(",", ":"))
    # (the key's quotes are the only unescaped ones around this text)
    return head.replace('"hash_ids":null', f'"hash_ids":{ids_json(req.hash_ids)}', 1)


def write_trace(trace: Trace, path: str | os.PathLike) -> None:
    """Write ``trace`` as labkit JSONL (gzipped if the name ends in .gz), atomically
    (temp file + rename), creating missing parent folders, and only as a regular file: a
    device, FIFO or directory at ``path`` is refused, not replaced. An error names
    ``path``, never the temporary file."""
    from labkit.outputs import check_regular_target

    target = check_regular_target(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.",
                                   suffix=".tmp")
    except OSError as err:
        blocked = next((p for p in target.parents if p.exists() and not p.is_dir()), None)
        reason = f"{blocked} is a file, not a folder" if blocked else err.strerror
        raise OSError(f"cannot write {path}: {reason}") from None
    try:
        with os.fdopen(fd, "wb") as raw:
            # A ``.gz`` target is compressed (block ids compress ~8x); mtime=0 keeps
            # the bytes reproducible. Closing the GzipFile leaves `raw` open.
            gz = target.name.endswith(".gz")
            stream = gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) if gz else raw
            text = io.TextIOWrapper(stream, encoding="utf-8")
            for req in trace.requests:
                text.write(_line(req, trace.block_size))
                text.write("\n")
            text.flush()
            text.detach()
            if gz:
                stream.close()
            raw.flush()
            os.fsync(raw.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a trace is an ordinary file
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
