"""What makes a trace well formed, and how a malformed one is reported.

A trace file is only useful if every request in it can be replayed: lengths are
positive, the prompt's block ids cover exactly its tokens, and every request that
continues another one (``parent_id``) names an *earlier* request of the *same*
session. We check all of that before anything else touches the trace, and stop at
the first problem with an error that points at the offending line::

    traces/run1.jsonl:17: parent_id 's3.m4' refers to a later request (line 20)

Two layers of checks live here:

* ``check_request`` -- one request on its own (lengths, block ids, kind);
* ``check_links``   -- how requests refer to each other (unique ids, parents).

The file loaders add a third, format-specific layer (JSON syntax, field names and
JSON types) and then call these two, so a trace built in Python gets the same
guarantees as one read from disk.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from numba import njit

if TYPE_CHECKING:  # only for annotations; schema imports this module
    from labkit.traces.schema import TraceRequest

# Block ids must fit in 40 bits: engines pack them together with other keys.
MAX_HASH_ID = 2**40
# Token counts past these are damage: no model reads a 134M-token prompt, and a
# longer one would have loaders mint ids by the gigabyte; outputs stay summable.
MAX_PROMPT_TOKENS = 2**27
MAX_OUTPUT_TOKENS = 2**40
KINDS = ("main", "subagent")


class TraceError(ValueError):
    """A malformed trace. ``str()`` reads ``"<path>:<line>: <reason>"`` (line is 1-based)."""

    def __init__(self, path: str, line: int, reason: str):
        super().__init__(f"{path}:{line}: {reason}")
        self.path = path
        self.line = line
        self.reason = reason


def check_request(req: TraceRequest, block_size: int, ids_in_range: bool = False) -> str | None:
    """Return why ``req`` is malformed on its own, or None when it is fine
    (``ids_in_range``: the caller has checked the ids' range for many requests at once)."""
    if req.kind not in KINDS:
        return f"kind must be 'main' or 'subagent', got {req.kind!r}"
    if not 0 < req.input_length <= MAX_PROMPT_TOKENS:
        return f"input_length must be > 0 and <= 2**27, got {req.input_length}"
    if not 1 <= req.output_length <= MAX_OUTPUT_TOKENS:
        return f"output_length must be >= 1 and <= 2**40, got {req.output_length}"
    if not (math.isfinite(req.delay_s) and req.delay_s >= 0):
        return f"delay_s must be a finite number >= 0, got {req.delay_s}"
    if req.timestamp is not None and not (math.isfinite(req.timestamp) and req.timestamp >= 0):
        return f"timestamp must be a finite number >= 0, got {req.timestamp}"
    ids = req.hash_ids
    if not isinstance(ids, np.ndarray) or ids.dtype != np.int64 or ids.ndim != 1:
        return "hash_ids must be a 1-D int64 array"
    expected = -(-req.input_length // block_size)  # ceil division
    if len(ids) != expected:
        return (f"hash_ids has {len(ids)} ids but input_length {req.input_length} "
                f"needs ceil({req.input_length}/{block_size}) = {expected}")
    if not ids_in_range and not _in_range(ids, MAX_HASH_ID):
        return "hash_ids must be integers in [0, 2**40)"
    return None


@njit(cache=True)
def _in_range(ids, limit: int) -> bool:
    """Is every id in [0, limit)? (One pass: a long prompt's ids are read twice
    by a min and a max.)"""
    for x in ids:
        if x < 0 or x >= limit:
            return False
    return True


def check_links(requests: Sequence[TraceRequest], path: str,
                lines: Sequence[int] | None = None) -> None:
    """Raise TraceError for the first request (in order) whose links are wrong.

    ``lines[i]`` is the file line of ``requests[i]`` (defaults to ``i + 1``).
    Rules: request ids are unique; a subagent call has a parent; a parent is an
    earlier request of the same session; a main call's parent is a main call with
    no other main child; a subagent call has at most one subagent child.
    """
    line_of = (lambda i: lines[i]) if lines is not None else (lambda i: i + 1)
    # Where each id first occurs, to say "later request (line N)" rather than "unknown".
    first_index: dict[str, int] = {}
    for i, req in enumerate(requests):
        first_index.setdefault(req.request_id, i)
    links = _Links()
    for i, req in enumerate(requests):
        reason = links.add(req, i, first_index, line_of)
        if reason:
            raise TraceError(path, line_of(i), reason)


class _Links:
    """The requests seen so far, and which of them already have a thread child."""

    def __init__(self) -> None:
        self.seen: dict[str, TraceRequest] = {}
        self.has_main_child: set[str] = set()
        self.has_subagent_child: set[str] = set()

    def add(self, req: TraceRequest, i: int, first_index: dict[str, int],
            line_of) -> str | None:
        """Record request ``i``; return why its links are wrong, or None."""
        if req.request_id in self.seen:
            return (f"duplicate request_id {req.request_id!r} "
                    f"(first at line {line_of(first_index[req.request_id])})")
        reason = self._parent_problem(req, i, first_index, line_of)
        self.seen[req.request_id] = req
        return reason

    def _parent_problem(self, req: TraceRequest, i: int, first_index: dict[str, int],
                        line_of) -> str | None:
        if req.parent_id is None:
            return ("a subagent call needs a parent_id (the main call it forks from)"
                    if req.kind == "subagent" else None)
        parent = self.seen.get(req.parent_id)
        if parent is None:
            later = first_index.get(req.parent_id)
            if later is not None and later >= i:
                return (f"parent_id {req.parent_id!r} refers to a later request "
                        f"(line {line_of(later)}); a parent must precede its children")
            return f"unknown parent_id {req.parent_id!r}"
        if parent.session_id != req.session_id:
            return (f"parent_id {req.parent_id!r} belongs to session {parent.session_id!r}, "
                    f"not {req.session_id!r}")
        if req.kind == "main":
            if parent.kind != "main":
                return f"main call's parent {req.parent_id!r} is a subagent call"
            if parent.request_id in self.has_main_child:
                return f"{req.parent_id!r} already has a main child"
            self.has_main_child.add(parent.request_id)
        elif parent.kind == "subagent":
            if parent.request_id in self.has_subagent_child:
                return f"{req.parent_id!r} already has a subagent child"
            self.has_subagent_child.add(parent.request_id)
        return None
