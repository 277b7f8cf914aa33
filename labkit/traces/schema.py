"""The canonical trace: requests whose prompts are lists of block ids.

A trace fixes a ``block_size`` (tokens per block). Each request's prompt is
described by its length and one id per block (the last block may be partial);
equal ids mean equal content, and -- after loading -- equal *prefixes*, because
ids are made chain-unique (see ``canonical.py``). That is all a serving engine
needs to reproduce prefix-cache behaviour.

Agentic sessions are threads of calls. ``parent_id`` says which call a request
continues:

* a **main** call's parent is the previous main call of the session (None for the
  first); each main call has at most one main child, its *successor*;
* a **subagent**'s first call has the main call it forks from as parent: its prompt
  starts with that call's input + output, then its own task. Later calls of the
  subagent have the previous call of that subagent as parent. Parallel subagents
  are siblings forked from the same main call.

Replay rule. Closed loop: a call is sent ``delay_s`` after its parent *and* the
calls in ``Trace.joins(call)`` have completed -- a main call whose parent spawned
subagents waits for them, since their reports are part of its prompt. Open loop
(``timestamp`` set, as in Mooncake traces): a call arrives at its timestamp.

The next call of a thread re-sends this call's output as part of its prompt, so
its ids also name the blocks holding this call's *generated* tokens.
``context_ids`` exposes them, so an engine can register generated KV under the
ids the next turn will look up.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from labkit.traces.canonical import canonicalize, id_range, largest_id
from labkit.traces.validate import MAX_HASH_ID, TraceError, check_links, check_request


@dataclass(slots=True, eq=False)
class TraceRequest:
    session_id: str
    request_id: str          # unique in the trace
    parent_id: str | None    # the call this one continues from (see module docstring)
    kind: str                # "main" | "subagent"
    delay_s: float           # idle time (tool run) after the parent completes
    input_length: int        # prompt tokens, > 0
    output_length: int       # generated tokens, >= 1
    hash_ids: np.ndarray     # int64, one id per block of the prompt
    timestamp: float | None = None   # absolute arrival (s) for open-loop traces
    priority: int = 0        # lower = more urgent (vLLM convention)

    def __eq__(self, other: object) -> bool:
        # Field-by-field, with numpy equality for the ids (the dataclass default
        # would ask numpy for the truth value of an array).
        if not isinstance(other, TraceRequest):
            return NotImplemented
        return (self.session_id == other.session_id and self.request_id == other.request_id
                and self.parent_id == other.parent_id and self.kind == other.kind
                and self.delay_s == other.delay_s and self.input_length == other.input_length
                and self.output_length == other.output_length
                and self.timestamp == other.timestamp and self.priority == other.priority
                and np.array_equal(self.hash_ids, other.hash_ids))

    __hash__ = None  # mutable


@dataclass(slots=True)
class Trace:
    """Requests in file order (a parent always precedes its children).

    Construction validates the requests (``TraceError`` on the first problem),
    converts ``hash_ids`` to int64 arrays, makes ids chain-unique (replacing the
    requests' ``hash_ids`` when the input was not), and builds the lookups once:
    treat the trace as read-only afterwards.
    """

    block_size: int
    requests: list[TraceRequest]
    source: str = field(default="", compare=False)  # path or "generated(...)"
    format: str = "labkit"                           # one of traces.formats.FORMATS
    _index: dict[str, int] = field(init=False, repr=False, compare=False)
    _parent: list[int] = field(init=False, repr=False, compare=False)     # -1: none
    _successor: list[int] = field(init=False, repr=False, compare=False)  # -1: none
    _children: dict[int, list[int]] = field(init=False, repr=False, compare=False)
    _sessions: list[list[int]] = field(init=False, repr=False, compare=False)
    _max_hash_id: int = field(init=False, repr=False, compare=False)
    # request index -> does its successor re-send its whole context (once asked; a
    # dict, not an array: a trace Ray hands a worker holds its arrays read-only)
    _resends: dict[int, bool] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        where = self.source or "<trace>"
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise TraceError(where, 1, f"block_size must be a positive integer, "
                                       f"got {self.block_size!r}")
        for req in self.requests:
            if not (isinstance(req.hash_ids, np.ndarray) and req.hash_ids.dtype == np.int64):
                req.hash_ids = np.asarray(req.hash_ids, dtype=np.int64)
        hash_lists = [r.hash_ids for r in self.requests]
        in_range = all(h.ndim == 1 for h in hash_lists)
        if in_range:  # every list's range at once; otherwise each list says
            low, self._max_hash_id = id_range(hash_lists)
            in_range = low >= 0 and self._max_hash_id < MAX_HASH_ID
        for i, req in enumerate(self.requests):
            reason = check_request(req, self.block_size, in_range)
            if reason:
                raise TraceError(where, i + 1, reason)
        check_links(self.requests, where)
        remapped = canonicalize(hash_lists, self._max_hash_id)
        if remapped is not None:
            for req, ids in zip(self.requests, remapped, strict=True):
                req.hash_ids = ids
            self._max_hash_id = largest_id(remapped)
        self._build_lookups()

    def _build_lookups(self) -> None:
        n = len(self.requests)
        self._index = {r.request_id: i for i, r in enumerate(self.requests)}
        self._parent = [-1] * n
        self._successor = [-1] * n
        self._resends = {}
        self._children = {}
        sessions: dict[str, list[int]] = {}
        for i, req in enumerate(self.requests):
            sessions.setdefault(req.session_id, []).append(i)
            if req.parent_id is None:
                continue
            p = self._index[req.parent_id]
            self._parent[i] = p
            self._children.setdefault(p, []).append(i)
            if req.kind == self.requests[p].kind:  # same thread: main->main, sub->sub
                self._successor[p] = i
        self._sessions = list(sessions.values())

    # -- lookups -------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.requests)

    def request(self, request_id: str) -> TraceRequest:
        return self.requests[self._index[request_id]]

    def sessions(self) -> list[list[TraceRequest]]:
        """Requests grouped by session, sessions in order of first appearance."""
        return [[self.requests[i] for i in idx] for idx in self._sessions]

    def children(self, req: TraceRequest) -> list[TraceRequest]:
        return [self.requests[i] for i in self._children.get(self._index[req.request_id], [])]

    def successor(self, req: TraceRequest) -> TraceRequest | None:
        """The next call of the same thread (main -> main child, subagent -> subagent child)."""
        s = self._successor[self._index[req.request_id]]
        return self.requests[s] if s >= 0 else None

    def parent(self, req: TraceRequest) -> TraceRequest | None:
        p = self._parent[self._index[req.request_id]]
        return self.requests[p] if p >= 0 else None

    def joins(self, req: TraceRequest) -> list[TraceRequest]:
        """Calls ``req`` waits for besides its parent: for a main call, the last call
        of every subagent forked from its parent (their results are in its prompt)."""
        parent = self.parent(req)
        if req.kind != "main" or parent is None:
            return []
        last_calls = []
        for child in self.children(parent):
            if child.kind != "subagent":
                continue
            while (nxt := self.successor(child)) is not None:
                child = nxt
            last_calls.append(child)
        return last_calls

    @property
    def max_hash_id(self) -> int:
        return self._max_hash_id

    # -- block ids of generated tokens ---------------------------------------
    def context_ids(self, req: TraceRequest) -> np.ndarray:
        """Ids of the blocks covering ``req``'s input *and output* tokens.

        Full input blocks come from ``req.hash_ids``; the rest (from block
        ``input_length // block_size`` on) from the successor's prompt, when the
        successor re-sends this call's whole context (same ids on req's full input
        blocks, and a prompt at least input + output long). Unknown positions are
        -1. The last block, if partial, gets the id of the successor's block at
        that position -- fuller than ours; engines only cache full blocks.
        Where all are known, a read-only view of the successor's ids.
        """
        n_ctx = -(-(req.input_length + req.output_length) // self.block_size)
        known = self.known_context_ids(req)
        if len(known) == n_ctx:
            return known
        return np.concatenate([known, np.full(n_ctx - len(known), -1, dtype=np.int64)])

    def known_context_ids(self, req: TraceRequest) -> np.ndarray:
        """The leading ids of `context_ids` that are known (no -1s): as long as the
        ids in the file, however large ``output_length`` is."""
        i = self._index[req.request_id]
        if self._successor_resends(i):
            # req's full input blocks (equal to its successor's there), then the
            # successor's: its first n_ctx ids, as a view (a replay keeps one per call:
            # copies cost ~35 KB per simulated second on `labkit bench sim`'s fast workload)
            n_ctx = -(-(req.input_length + req.output_length) // self.block_size)
            known = self.requests[self._successor[i]].hash_ids[:n_ctx]
            known.flags.writeable = False
            return known
        return req.hash_ids[: req.input_length // self.block_size].copy()

    def _successor_resends(self, i: int) -> bool:
        """Does request i's successor re-send i's whole context: a prompt at least i's
        input + output long, with i's ids on i's full input blocks? (Asked of a call
        when it is replayed and again of it as its successor's parent: answered once.)"""
        answer = self._resends.get(i)
        if answer is None:
            req, s = self.requests[i], self._successor[i]
            nxt = self.requests[s] if s >= 0 else None
            n_full_in = req.input_length // self.block_size
            answer = bool(nxt is not None
                          and nxt.input_length >= req.input_length + req.output_length
                          and np.array_equal(nxt.hash_ids[:n_full_in],
                                             req.hash_ids[:n_full_in]))
            self._resends[i] = answer
        return answer

    def fork_tokens(self, req: TraceRequest) -> int:
        """For a subagent's first call: leading prompt tokens equal to its parent's
        context (parent input + output), else 0 (see `context_shared_tokens`)."""
        parent = self.parent(req)
        if req.kind != "subagent" or parent is None or parent.kind != "main":
            return 0
        return self.context_shared_tokens(req)

    def context_shared_tokens(self, req: TraceRequest) -> int:
        """Leading prompt tokens of `req` that re-send its parent's context (parent
        input + output), as their block ids say; 0 without a parent. Counted in whole
        blocks when the prompt departs from that context before its last full block."""
        i = self._index[req.request_id]
        p = self._parent[i]
        if p < 0:
            return 0
        parent, bs = self.requests[p], self.block_size
        ctx_tokens = parent.input_length + parent.output_length
        n_full = ctx_tokens // bs
        mine = req.hash_ids[:n_full]
        m = len(mine)  # past the known ids nothing agrees
        if self._successor[p] == i and self._successor_resends(p):
            n_agree = m  # the parent's known ids are req's own: they agree
        else:
            ctx = self.known_context_ids(parent)[:n_full]
            m = min(m, len(ctx))
            agree = mine[:m] == ctx[:m]
            n_agree = m if agree.all() else int(np.argmin(agree))  # first mismatch
        if n_agree == n_full:
            return min(ctx_tokens, req.input_length)
        return min(n_agree * bs, req.input_length)
