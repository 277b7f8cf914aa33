"""AgentX / Weka-style agentic traces: one JSON object per coding-agent conversation.

The agentic coding traces replayed by SemiAnalysis' AgentX and by
``callanjfox/kv-cache-tester`` (the "Weka" traces; aiperf and inference-perf read them
too) describe one conversation per *trace object*::

    {"id": "f64a8d4c-12d", "block_size": 64, "hash_id_scope": "local",
     "tool_tokens": 11899, "system_tokens": 2926,
     "requests": [
       {"t": 0.0, "type": "s", "in": 25259, "out": 86, "hash_ids": [1, 2, ...],
        "think_time": 0.0, "api_time": 3.1},
       {"t": 9.4, "type": "subagent", "agent_id": "agent_001", "duration_ms": 52000,
        "requests": [{"t": 9.5, "type": "n", "in": 9120, "out": 410, ...}, ...]},
       ...]}

* ``type`` "s" / "n" is a streaming / non-streaming call of the main agent; a
  ``"subagent"`` entry spawns a subagent whose own calls are nested in it. Subagents
  listed one after another run in parallel; the main agent's next call waits for
  all of them (their reports are in its prompt).
* ``in`` / ``out`` are prompt and output tokens; ``hash_ids`` one id per
  ``block_size``-token block of the prompt, equal ids = equal content. With
  ``hash_id_scope`` "local" (the default) ids mean something only inside their trace
  object; with "global" they are shared across objects (common tool definitions).
* ``t`` is the call's start in seconds from the conversation's start (a nested call's
  ``t`` before its subagent's ``t`` is relative to it, as in older files);
  ``think_time`` the client's delay before the call; ``api_time`` the server's time
  on it. Other fields (``model``, ``stop``, ``ttft``, ``input_types``, ``totals``,
  ...) are accepted and not used.

A file holds one object, a JSON list of them, or one per line (JSON lines).

How we load it. Each object is a session named by its ``id``. Main calls are
``<id>.m000, <id>.m001, ...``, each the parent of the next; the calls of the k-th
subagent are ``<id>.sa<k>.000, ...`` of kind "subagent", the first one forked from
the main call before the marker (a subagent listed before any main call becomes a
session ``<id>.sa<k>`` of its own). A call's ``delay_s`` (closed-loop idle time after
what it waits for) is its ``think_time`` when recorded, else the recorded idle gap:
its ``t`` minus the end (``t + api_time``) of the call before it -- for a main call
after subagents, of the last of them to end (``duration_ms`` counts when given).
There are no absolute arrival times, so calls carry no ``timestamp``: replay these
traces in a closed loop. Ids are renumbered per trace ("local") or across the file
("global") so that objects never share ids by accident; prompts without
``hash_ids`` get fresh ids; an ``out`` of 0 is replayed as 1 (``common.py``).
"""
from __future__ import annotations

import json
import math

import numpy as np

from labkit.traces.formats.common import compact_ids, fresh_blocks, output_tokens
from labkit.traces.id_lists import loads
from labkit.traces.jsonl import (FieldSpec, check_fields, first_line, id_array, open_text,
                                  read_objects)
from labkit.traces.schema import Trace, TraceRequest
from labkit.traces.streams import IdMinter
from labkit.traces.validate import TraceError, check_request

TRACE_FIELDS: FieldSpec = {  # name: (JSON type, required, nullable); others are ignored
    "id": ("string", True, False),
    "block_size": ("integer", True, False),
    "hash_id_scope": ("string", False, False),
}
CALL_FIELDS: FieldSpec = {
    "t": ("number", True, False),
    "type": ("string", True, False),
    "in": ("integer", True, False),
    "out": ("integer", True, False),
    "hash_ids": ("list of integers", False, False),
    "think_time": ("number", False, True),
    "api_time": ("number", False, True),
}
SUBAGENT_FIELDS: FieldSpec = {
    "t": ("number", True, False),
    "duration_ms": ("number", False, True),
}
CALL_TYPES = ("s", "n")
SCOPES = ("local", "global")


def load_agentx(path: str) -> Trace:
    """Read AgentX / Weka-style trace objects (TraceError names the object's line)."""
    block_size, seen = None, {}
    calls: list[_Call] = []
    for line, obj in _trace_objects(path):
        where = (path, line)
        _check(obj, TRACE_FIELDS, where, "trace object")
        tid, size = obj["id"], obj["block_size"]
        if tid in seen:
            raise TraceError(path, line, f"duplicate trace id {tid!r} (first at line "
                                         f"{seen[tid]})")
        seen[tid] = line
        if size <= 0 or (block_size is not None and size != block_size):
            raise TraceError(path, line, f"trace {tid!r}: block_size {size} must be > 0 and "
                                         f"the same in every trace ({block_size})")
        block_size = size
        scope = obj.get("hash_id_scope", "local")
        if scope not in SCOPES:
            raise TraceError(path, line, f"trace {tid!r}: hash_id_scope must be one of "
                                         f"{', '.join(SCOPES)}, got {scope!r}")
        if not isinstance(obj.get("requests"), list):
            raise TraceError(path, line, f"trace {tid!r}: field 'requests' must be a list")
        calls += _Conversation(tid, scope, where).calls(obj["requests"])
    if not calls:
        raise TraceError(path, 1, "empty trace: no requests")
    _assign_ids(calls, block_size)
    requests = []
    for call in calls:
        reason = check_request(call.request, block_size)
        if reason:
            raise TraceError(*call.where, f"{call.label}: {reason}")
        requests.append(call.request)
    return Trace(block_size, requests, source=path, format="agentx")


class _Call:
    """A request being built, with where it came from and its raw ids."""

    __slots__ = ("label", "raw_ids", "request", "scope", "trace_id", "where")

    def __init__(self, request: TraceRequest, raw_ids: np.ndarray | None, trace_id: str,
                 scope: str, where: tuple[str, int], label: str) -> None:
        self.request, self.raw_ids, self.trace_id = request, raw_ids, trace_id
        self.scope, self.where, self.label = scope, where, label


class _Conversation:
    """One trace object's entries, turned into labkit calls in replay order."""

    def __init__(self, trace_id: str, scope: str, where: tuple[str, int]) -> None:
        self.tid, self.scope, self.where = trace_id, scope, where
        self.out: list[_Call] = []

    def calls(self, entries: list) -> list[_Call]:
        last_main: TraceRequest | None = None
        main_end = waits_end = 0.0   # end of the last main call / of all it waits for
        mains = subagents = 0
        for k, entry in enumerate(entries):
            label = f"trace {self.tid!r} requests[{k}]"
            kind = entry.get("type") if isinstance(entry, dict) else None
            if kind in CALL_TYPES:
                _check(entry, CALL_FIELDS, self.where, label)
                last_main = self._call(entry, label, f"{self.tid}.m{mains:03d}", self.tid,
                                       "main", last_main,
                                       waits_end - entry["t"] if last_main else None)
                main_end = waits_end = entry["t"] + _api_time(entry)
                mains += 1
            elif kind == "subagent":
                _check(entry, SUBAGENT_FIELDS, self.where, label)
                end = self._subagent(entry, label, f"{self.tid}.sa{subagents:02d}",
                                     last_main, main_end)
                waits_end = max(waits_end, end)
                subagents += 1
            else:
                raise TraceError(*self.where, f"{label}: expected an object with 'type' "
                                              f"one of 's', 'n', 'subagent'")
        return self.out

    def _subagent(self, entry: dict, label: str, name: str, parent: TraceRequest | None,
                  parent_end: float) -> float:
        """Emit a subagent's calls; return when it ended."""
        inner = entry.get("requests")
        if not isinstance(inner, list):
            raise TraceError(*self.where, f"{label}: field 'requests' must be a list")
        # Forked from the main call before it; with none, a session of its own.
        session, kind = (self.tid, "subagent") if parent is not None else (name, "main")
        end = parent_end
        for j, call in enumerate(inner):
            where = f"{label}.requests[{j}]"
            if not (isinstance(call, dict) and call.get("type") in CALL_TYPES):
                raise TraceError(*self.where, f"{where}: expected a call of type 's' or 'n' "
                                              f"(nested subagents are not supported)")
            _check(call, CALL_FIELDS, self.where, where)
            start = call["t"] if call["t"] + 1e-6 >= entry["t"] else entry["t"] + call["t"]
            parent = self._call(call, where, f"{name}.{j:03d}", session, kind, parent,
                                end - start if parent is not None else None)
            end = start + _api_time(call)
        if entry.get("duration_ms") is not None:
            end = max(end, entry["t"] + entry["duration_ms"] / 1000)
        return end

    def _call(self, entry: dict, label: str, rid: str, session: str, kind: str,
              parent: TraceRequest | None, minus_idle: float | None) -> TraceRequest:
        """One (checked) call; ``minus_idle`` is (end of what it waits for) - (its start)."""
        think = entry.get("think_time")
        if think is not None and math.isfinite(think):
            delay = max(think, 0.0)
        else:
            delay = max(-minus_idle, 0.0) if minus_idle is not None else 0.0
        ids = entry.get("hash_ids")
        req = TraceRequest(
            session_id=session, request_id=rid,
            parent_id=parent.request_id if parent is not None else None, kind=kind,
            delay_s=float(delay), input_length=entry["in"],
            output_length=output_tokens(entry["out"]), hash_ids=np.empty(0, np.int64))
        raw = id_array(ids, *self.where) if ids is not None and len(ids) else None
        self.out.append(_Call(req, raw, self.tid, self.scope, self.where, label))
        return req


def _api_time(entry: dict) -> float:
    api = entry.get("api_time")
    return max(api, 0.0) if api is not None and math.isfinite(api) else 0.0


def _check(obj, spec: FieldSpec, where: tuple[str, int], label: str) -> None:
    """Type-check the fields we use (others are ignored), naming the entry."""
    if not isinstance(obj, dict):
        raise TraceError(*where, f"{label}: expected a JSON object")
    try:
        check_fields({k: v for k, v in obj.items() if k in spec}, spec, *where)
    except TraceError as err:
        raise TraceError(*where, f"{label}: {err.reason}") from None


def _assign_ids(calls: list[_Call], block_size: int) -> None:
    """Renumber ids per trace ("local") or across traces ("global"), then give fresh
    ids to prompts that came without any."""
    groups: dict[tuple[str, str], list[_Call]] = {}
    for call in calls:
        if call.raw_ids is not None:
            key = ("global", "") if call.scope == "global" else ("local", call.trace_id)
            groups.setdefault(key, []).append(call)
    offset = 0
    for group in groups.values():
        ids, offset = compact_ids([c.raw_ids for c in group], offset)
        for call, new in zip(group, ids, strict=True):
            call.request.hash_ids = new
    minter = IdMinter(offset)
    for call in calls:
        if call.raw_ids is None:
            call.request.hash_ids = minter.take(fresh_blocks(call.request.input_length,
                                                             block_size))


def _trace_objects(path: str) -> list[tuple[int, object]]:
    """``(line, object)`` for each trace object: one per line, a list, or one. (Their
    hash_ids lists are read as arrays where `id_lists.py` can.)"""
    start, first = first_line(path)
    if first is None:
        raise TraceError(path, 1, "empty trace: no requests")
    try:
        if isinstance(loads(first), dict):
            return list(read_objects(path))     # JSON lines
    except json.JSONDecodeError:
        pass                                    # an object or list over several lines
    with open_text(path) as f:
        text = f.read()
    try:
        doc = loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(path, e.lineno, f"invalid JSON: {e.msg} (column {e.colno})") from None
    return [(start, obj) for obj in doc] if isinstance(doc, list) else [(start, doc)]
