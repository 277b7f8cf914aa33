"""Qwen-Bailian traces: chat turns linked into conversations.

Alibaba published two hours of anonymised requests to one Qwen serving instance
(``alibaba-edu/qwen-bailian-usagetraces-anon``) as JSON lines::

    {"chat_id": 159, "parent_chat_id": 55, "timestamp": 61.114, "input_length": 521,
     "output_length": 132, "type": "text", "turn": 2, "hash_ids": [1089, 1090, ...]}

* ``chat_id`` names the request; ``parent_chat_id`` the request this turn continues
  (-1 for the first turn of a conversation); ``turn`` counts turns (1 = first);
* ``timestamp`` is the arrival in **seconds** from the start of the trace;
* ``hash_ids`` has one id per **16-token** block of the whole prompt (a follow-up
  turn's prompt includes the history), equal ids = equal content (a row without
  them gets fresh ids: no reuse is invented);
* ``type`` is text / search / image / file (not kept: an engine serves them alike;
  ``where="type=text"`` reads the text turns alone).

How we load it. Following parent links from a turn back to its root gives its
conversation: one labkit session ``bl-<root chat_id>``, each turn a main call
(``bl-<chat_id>``) whose parent is the turn it continues. Requests are ordered by
arrival (file order on ties), so parents come first. Each keeps its ``timestamp``
(open loop replays it as published) and, for a closed loop, ``delay_s`` = the gap
between its parent's arrival and its own -- an upper bound on the user's think
time, since in production it also covered the parent's service time.

Two things the published files do that labkit sessions do not: a parent outside
the file (the two-hour window cut the conversation) -- the turn then starts its
own session; and a turn answered twice (two requests name the same parent, e.g. a
regenerated answer) -- the earliest continues the conversation, each later one
starts a session of its own (its shared history still hits the prefix cache,
since its block ids say so).
"""
from __future__ import annotations

from labkit.traces.formats.common import (
    compact_ids, fresh_blocks, needs_compacting, output_tokens)
from labkit.traces.formats.row_filter import RowFilter
from labkit.traces.jsonl import FieldSpec, check_fields, id_array, read_objects
from labkit.traces.schema import Trace, TraceRequest
from labkit.traces.streams import IdMinter
from labkit.traces.validate import TraceError, check_request

BAILIAN_BLOCK_SIZE = 16
ROOT = -1  # the parent_chat_id of a first turn

BAILIAN_FIELDS: FieldSpec = {  # name: (JSON type, required, nullable)
    "chat_id": ("integer", True, False),
    "parent_chat_id": ("integer", False, False),
    "timestamp": ("number", True, False),
    "input_length": ("integer", True, False),
    "output_length": ("integer", True, False),
    "type": ("string", False, False),
    "turn": ("integer", False, False),
    "hash_ids": ("list of integers", False, False),
}


def load_bailian(path: str, where: RowFilter | None = None) -> Trace:
    """Read a Qwen-Bailian JSONL trace (TraceError names the first bad line); ``where``:
    only the lines it accepts (`row_filter.py`: a turn whose parent it drops starts a
    conversation of its own, as one whose parent is outside the file)."""
    rows: list[tuple[int, dict]] = []
    line_of: dict[int, int] = {}
    lines = read_objects(path)
    for line, obj in lines if where is None else where.kept(lines, path):
        check_fields(obj, BAILIAN_FIELDS, path, line)
        chat = obj["chat_id"]
        if chat == ROOT or chat == obj.get("parent_chat_id", ROOT):
            raise TraceError(path, line, f"chat_id {chat} cannot be a chat's own parent "
                                         f"(parent_chat_id {ROOT} marks a first turn)")
        if chat in line_of:
            raise TraceError(path, line, f"duplicate chat_id {chat} (first at line "
                                         f"{line_of[chat]})")
        line_of[chat] = line
        rows.append((line, obj))
    if not rows:
        raise TraceError(path, 1, "empty trace: no requests")
    rows.sort(key=lambda row: (row[1]["timestamp"], row[0]))  # by arrival, stable
    position = {obj["chat_id"]: i for i, (_, obj) in enumerate(rows)}

    hash_lists = [id_array(obj["hash_ids"], path, line) if "hash_ids" in obj else None
                  for line, obj in rows]
    given = [h for h in hash_lists if h is not None]
    if needs_compacting(given):
        compacted = iter(compact_ids(given)[0])
        hash_lists = [next(compacted) if h is not None else None for h in hash_lists]
    # A row without hash_ids (allowed by aiperf's reader) gets ids nothing else has.
    fresh = IdMinter(max((int(h.max()) for h in hash_lists if h is not None and len(h)),
                         default=-1) + 1)
    session_of: dict[int, str] = {}
    continued: set[int] = set()        # chats that already have a follow-up turn
    requests: list[TraceRequest] = []
    for (line, obj), ids in zip(rows, hash_lists, strict=True):
        chat, parent = obj["chat_id"], obj.get("parent_chat_id", ROOT)
        if parent in position and position[parent] > position[chat]:
            raise TraceError(path, line, f"parent_chat_id {parent} arrives after this "
                                         f"request (line {line_of[parent]})")
        continues = parent in position and parent not in continued
        if continues:
            continued.add(parent)
            session_of[chat] = session_of[parent]
            parent_id, delay = f"bl-{parent}", obj["timestamp"] - rows[position[parent]][1][
                "timestamp"]
        else:
            session_of[chat] = f"bl-{chat}"
            parent_id, delay = None, 0.0
        req = TraceRequest(
            session_id=session_of[chat], request_id=f"bl-{chat}", parent_id=parent_id,
            kind="main", delay_s=float(delay), input_length=obj["input_length"],
            output_length=output_tokens(obj["output_length"]),
            hash_ids=ids if ids is not None else fresh.take(
                fresh_blocks(obj["input_length"], BAILIAN_BLOCK_SIZE)),
            timestamp=float(obj["timestamp"]))
        reason = check_request(req, BAILIAN_BLOCK_SIZE)
        if reason:
            raise TraceError(path, line, reason)
        requests.append(req)
    return Trace(BAILIAN_BLOCK_SIZE, requests, source=path, format="bailian")
