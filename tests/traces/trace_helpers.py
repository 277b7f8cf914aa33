"""Helpers for hand-made traces, shared by the trace tests (conftest puts this
folder on sys.path, so ``from trace_helpers import req`` works in any import mode)."""
from __future__ import annotations

import numpy as np

from labkit.traces import TraceRequest


def req(request_id: str, input_length: int, hash_ids, *, session: str = "s",
        parent: str | None = None, kind: str = "main", output_length: int = 1,
        delay_s: float = 0.0, timestamp: float | None = None,
        priority: int = 0) -> TraceRequest:
    """A TraceRequest with short arguments."""
    return TraceRequest(session, request_id, parent, kind, delay_s, input_length,
                        output_length, np.asarray(hash_ids, dtype=np.int64),
                        timestamp, priority)


def naive_context(requests: list[TraceRequest], r: TraceRequest, bs: int) -> list[int]:
    """context_ids written the slow, obvious way: scan for the same-thread child."""
    n_full_in = r.input_length // bs
    n_ctx = -(-(r.input_length + r.output_length) // bs)
    ctx = [int(x) for x in r.hash_ids[:n_full_in]] + [-1] * (n_ctx - n_full_in)
    for s in requests:
        if (s.parent_id == r.request_id and s.kind == r.kind
                and s.input_length >= r.input_length + r.output_length
                and list(s.hash_ids[:n_full_in]) == list(r.hash_ids[:n_full_in])):
            ctx[n_full_in:] = [int(x) for x in s.hash_ids[n_full_in:n_ctx]]
    return ctx


def naive_prefix_reuse(requests: list[TraceRequest], bs: int) -> float:
    """Infinite prefix cache keyed by explicit chains (predecessor key, id): no
    reliance on ids being chain-unique. ``requests`` carry *raw* ids."""
    chain_key: dict[tuple[int, int], int] = {}   # (predecessor key, id) -> key

    def keys(ids) -> list[int]:
        out, prev = [], -1
        for x in ids:
            prev = chain_key.setdefault((prev, int(x)), len(chain_key))
            out.append(prev)
        return out

    cache: set[int] = set()
    matched = total = 0
    for r in requests:
        k = keys(r.hash_ids)
        cap = (r.input_length - 1) // bs
        m = 0
        while m < cap and k[m] in cache:
            m += 1
        matched += m * bs
        total += r.input_length
        ctx = naive_context(requests, r, bs)[:(r.input_length + r.output_length) // bs]
        if -1 in ctx:
            ctx = ctx[:ctx.index(-1)]
        cache.update(keys(ctx))
    return matched / total
