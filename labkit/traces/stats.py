"""Summary statistics of a trace, comparable with published workload figures.

The headline numbers of agentic traces (SemiAnalysis AgentX) are: main-agent calls
per session, input and output tokens per call, the share of sessions that spawn
subagents (and how many), and **prefix reuse** -- the fraction of input tokens an
*infinite* prefix cache would serve. ``trace_stats`` computes all of them.

Prefix reuse processes requests in file order. A request hits the longest prefix
of its full input blocks already in the cache, capped so that at least one token
is recomputed (a model needs the last token's logits):
``matched_tokens = min(matched_blocks, (input_length - 1) // block_size) * block_size``.
Then the ids of its whole *context* -- input and generated output, full blocks only
(``Trace.context_ids``) -- enter the cache. With chain-unique ids an id in the
cache implies its whole prefix is, so "longest cached prefix" is "leading run of
ids that entered the cache before this request": one compiled pass over the
requests with a table of the ids cached so far, the contexts joined a chunk of
requests at a time (a 400-session trace holds ~40M ids).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from labkit.traces.schema import Trace


def prefix_reuse(trace: Trace) -> float:
    """Fraction of input tokens an infinite prefix cache serves (see module doc)."""
    bs, n = trace.block_size, len(trace)
    if n == 0:
        return 0.0
    inputs = np.array([r.input_length for r in trace.requests], dtype=np.int64)
    candidates = (inputs - 1) // bs  # the blocks request r may hit
    matched = np.empty(n, dtype=np.int64)
    top = trace.max_hash_id
    if top >= 4 * int((inputs // bs).sum()) + 2**20:  # sparse ids: renamed densely first
        ids, counts = _contexts(trace, 0, n)
        _, dense = np.unique(ids, return_inverse=True)
        cached = np.zeros(len(dense) + 1, dtype=np.bool_)
        _leading_hits(dense.astype(np.int64, copy=False), counts, candidates, cached, matched)
        return float((matched * bs).sum() / inputs.sum())
    cached = np.zeros(top + 1, dtype=np.bool_)  # ids some request so far has cached
    first = 0
    while first < n:  # a chunk of requests at a time: their contexts joined, not all
        last, size = first, 0
        while last < n and (size < CHUNK_IDS or last == first):
            size += (inputs[last] + trace.requests[last].output_length) // bs
            last += 1
        ids, counts = _contexts(trace, first, last)
        _leading_hits(ids, counts, candidates[first:last], cached, matched[first:last])
        first = last
    return float((matched * bs).sum() / inputs.sum())


CHUNK_IDS = 1 << 22  # context ids joined at a time (32 MB)


def _contexts(trace: Trace, first: int, last: int) -> tuple[np.ndarray, np.ndarray]:
    """The ids requests [first, last) add to the cache (their full context blocks, up
    to the first unknown one), one after another, and how many each adds."""
    bs = trace.block_size
    parts = [trace.known_context_ids(r)[:(r.input_length + r.output_length) // bs]
             for r in trace.requests[first:last]]  # (known ids only: a huge
    counts = np.array([len(p) for p in parts], dtype=np.int64)  # output_length adds none)
    return (np.concatenate(parts) if parts else np.empty(0, np.int64)), counts


@njit(cache=True)
def _leading_hits(ids, counts, candidates, cached, matched) -> None:
    """Request by request, in order: matched[r] = how many of its first candidates[r]
    ids (its leading ones in `ids`) were cached before it, up to the first that was
    not; then its `counts[r]` ids are cached."""
    at = 0
    for r in range(len(counts)):
        m, stop = 0, min(candidates[r], counts[r])
        while m < stop and cached[ids[at + m]]:
            m += 1
        matched[r] = m
        for k in range(at, at + counts[r]):
            cached[ids[k]] = True
        at += counts[r]


def _percentile(x: np.ndarray, q: float) -> float:
    return float(np.percentile(x, q)) if len(x) else 0.0


def trace_stats(trace: Trace) -> dict:
    """Headline statistics (JSON-serialisable): see the module docstring."""
    reqs = trace.requests
    inputs = np.array([r.input_length for r in reqs], dtype=np.int64)
    outputs = np.array([r.output_length for r in reqs], dtype=np.int64)
    sessions = trace.sessions()
    main_calls = np.array([sum(r.kind == "main" for r in s) for s in sessions])
    # A subagent is counted by its first call: a subagent call whose parent is main.
    forks = np.array([sum(r.kind == "subagent" and trace.parent(r).kind == "main" for r in s)
                      for s in sessions])
    spawning = forks > 0
    stamps = [r.timestamp for r in reqs if r.timestamp is not None]
    gaps = np.array([r.delay_s for r in reqs if r.parent_id is not None])
    return {
        "source": trace.source,
        "format": trace.format,
        "block_size": trace.block_size,
        "sessions": len(sessions),
        "requests": len(reqs),
        "main_calls": int(main_calls.sum()),
        "subagent_calls": int(len(reqs) - main_calls.sum()),
        "calls_per_session_median": float(np.median(main_calls)) if len(reqs) else 0.0,
        "calls_per_session_mean": float(main_calls.mean()) if len(reqs) else 0.0,
        "input_tokens_median": float(np.median(inputs)) if len(reqs) else 0.0,
        "input_tokens_mean": float(inputs.mean()) if len(reqs) else 0.0,
        "input_tokens_p90": _percentile(inputs, 90),
        "output_tokens_median": float(np.median(outputs)) if len(reqs) else 0.0,
        "output_tokens_mean": float(outputs.mean()) if len(reqs) else 0.0,
        "output_tokens_p90": _percentile(outputs, 90),
        "total_input_tokens": int(inputs.sum()),
        "total_output_tokens": int(outputs.sum()),
        "prefix_reuse": prefix_reuse(trace),
        "subagent_session_share": float(spawning.mean()) if len(sessions) else 0.0,
        "subagents_per_spawning_session_mean":
            float(forks[spawning].mean()) if spawning.any() else 0.0,
        "subagents": int(forks.sum()),
        "delay_s_median": float(np.median(gaps)) if len(gaps) else 0.0,
        "delay_s_p90": _percentile(gaps, 90),
        "duration_s": (max(stamps) - min(stamps)) if stamps else None,
        # arrivals per second over their span: what an open-loop replay offers
        "request_rate": (len(stamps) - 1) / (max(stamps) - min(stamps))
        if len(stamps) > 1 and max(stamps) > min(stamps) else None,
        "max_hash_id": trace.max_hash_id,
    }
