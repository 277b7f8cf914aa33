"""Telling a trace's format from its first line.

Each published format has a recognisable first line:

* a JSON object -- labkit (``request_id`` / ``block_size``), Mooncake (``timestamp`` +
  ``hash_ids``), Qwen-Bailian (``chat_id``), AgentX / Weka (a trace object with
  ``requests``; also a JSON list of them, or one object over several lines);
* a CSV header -- Azure (``TIMESTAMP,ContextTokens,GeneratedTokens``), BurstGPT
  (``Timestamp,...,Request tokens,Response tokens,...``), Splitwise
  (``...,arrival_timestamp,...,prompt_size,token_size``).

Anything else is a TraceError on line 1 that lists the formats and asks for one.
"""
from __future__ import annotations

import csv
import json
import zlib

from labkit.traces.formats.azure import AZURE_COLUMNS
from labkit.traces.formats.burstgpt import BURSTGPT_COLUMNS
from labkit.traces.formats.splitwise import SPLITWISE_COLUMNS
from labkit.traces.id_lists import loads
from labkit.traces.jsonl import first_line, open_text
from labkit.traces.validate import TraceError

CSV_FORMATS = {"azure": AZURE_COLUMNS, "burstgpt": BURSTGPT_COLUMNS,
               "splitwise": SPLITWISE_COLUMNS}


def detect_format(path: str, formats: tuple[str, ...]) -> str:
    """The format of the file at ``path`` (one of ``formats``), from its first line."""
    line_no, head = first_line(path)
    if head is None:
        return "labkit"  # empty: the labkit loader reports it
    if head.startswith("[") or head == "{":  # a list, or one object spread over lines
        return "agentx"  # (not parsed here: its loader reads it once, and names damage)
    if head.startswith("{"):
        try:
            obj = json.loads(head)
        except json.JSONDecodeError:
            return _multi_line_object(path, line_no)
        keys = set(obj) if isinstance(obj, dict) else set()
        if "requests" in keys:
            return "agentx"
        if "chat_id" in keys:
            return "bailian"
        if {"timestamp", "hash_ids"} <= keys and not keys & {"request_id", "block_size"}:
            return "mooncake"
        return "labkit"  # its loader names a missing or unknown field
    columns = {c.strip() for c in next(csv.reader([head]))}
    for name, required in CSV_FORMATS.items():
        if set(required) <= columns:
            return name
    raise TraceError(path, line_no, f"cannot tell the trace format from this line; give "
                                    f"format= (--format) one of {', '.join(formats)}")


def _multi_line_object(path: str, line_no: int) -> str:
    """A first line that is not JSON on its own: an AgentX object spread over lines,
    or a damaged JSON-lines file (then the labkit loader reports the bad line)."""
    with open_text(path) as f:
        try:
            doc = loads(f.read())  # (ids read as arrays: quicker than json's lists)
        except (json.JSONDecodeError, UnicodeDecodeError, EOFError, OSError, zlib.error):
            return "labkit"  # its loader names the damaged line
    return "agentx" if isinstance(doc, (dict, list)) else "labkit"
