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
ids that entered the cache before this request": one scatter of first-entry
times and one segmented minimum, no per-block Python loop.
"""
from __future__ import annotations

import numpy as np

from labkit.traces.schema import Trace


def _cache_insertions(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """Ids each request adds to the cache (its full context blocks, up to the first
    unknown one), all in one array, and how many each request adds.

    Segment ``r`` of the array holds request ``r``'s ids in block order, so its
    leading ``input_length // block_size`` entries are its full *input* blocks.
    """
    bs = trace.block_size
    parts, counts = [], np.empty(len(trace), dtype=np.int64)
    for i, req in enumerate(trace.requests):
        # known ids only: a huge output_length must not become a huge array of -1s
        ctx = trace.known_context_ids(req)[:(req.input_length + req.output_length) // bs]
        parts.append(ctx)
        counts[i] = len(ctx)
    ids = np.concatenate(parts) if parts else np.empty(0, np.int64)
    return ids, counts


def prefix_reuse(trace: Trace) -> float:
    """Fraction of input tokens an infinite prefix cache serves (see module doc)."""
    bs, n = trace.block_size, len(trace)
    inputs = np.array([r.input_length for r in trace.requests], dtype=np.int64)
    if n == 0:
        return 0.0
    ids, counts = _cache_insertions(trace)
    # When each id first entered the cache: the index of the first request adding it.
    top = int(ids.max()) if len(ids) else -1
    if top < 4 * len(ids) + 2**20:
        dense = ids  # ids are small enough to index a table directly
    else:
        _, dense = np.unique(ids, return_inverse=True)
        top = int(dense.max())
    first_entry = np.full(top + 1, n, dtype=np.int32)
    np.minimum.at(first_entry, dense, np.repeat(np.arange(n, dtype=np.int32), counts))

    # Request r may hit its first (input_length - 1) // bs blocks: the leading entries
    # of its segment in `ids`. A block misses when no *earlier* request added its id.
    candidates = (inputs - 1) // bs
    seg_starts = np.cumsum(counts) - counts
    cand_starts = np.cumsum(candidates) - candidates
    total = int(candidates.sum())
    where = np.arange(total, dtype=np.int64) + np.repeat(seg_starts - cand_starts, candidates)
    cand_owner = np.repeat(np.arange(n, dtype=np.int32), candidates)
    misses = np.flatnonzero(first_entry[dense[where]] >= cand_owner)
    # Each request's hit run ends at its first miss (misses are sorted by request).
    miss_owner = cand_owner[misses]
    first = np.ones(len(misses), dtype=bool)
    first[1:] = miss_owner[1:] != miss_owner[:-1]
    matched = candidates.copy()
    matched[miss_owner[first]] = misses[first] - cand_starts[miss_owner[first]]
    return float((matched * bs).sum() / inputs.sum())


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
        "max_hash_id": trace.max_hash_id,
    }
