"""The recurrent state of linear-attention (KDA) layers, per request.

A linear-attention layer keeps no per-token KV: each request carries a fixed-size
state (a short-conv history and a `[heads, dk, dv]` matrix) that every token updates.
The state is kept by position — "the state after the first p tokens" — so that a
speculative verify step can store one candidate per draft and the next step simply
reads the state at its context length (the accepted prefix); candidates past it are
dropped. A request that restarts from 0 (preempted, recomputed) starts afresh.

Such a state summarises a whole prefix and cannot be rebuilt from paged blocks, which
is why the compute plane turns prefix caching off for hybrid models.
"""

from __future__ import annotations


class LinearStates:
    def __init__(self) -> None:
        self._states: dict[tuple[int, str], dict[int, object]] = {}

    def get(self, layer: int, request_id: str, position: int):
        """The state after `position` tokens (None at 0: a fresh sequence)."""
        if position == 0:
            self._states.pop((layer, request_id), None)
            return None
        kept = self._states.get((layer, request_id), {})
        if position not in kept:
            raise RuntimeError(f"no linear-attention state of {request_id} after "
                               f"{position} tokens in layer {layer} (have {sorted(kept)})")
        state = kept[position]
        self._states[(layer, request_id)] = {position: state}
        return state

    def put(self, layer: int, request_id: str, position: int, state) -> None:
        self._states.setdefault((layer, request_id), {})[position] = state

    def release(self, request_id: str) -> None:
        for key in [k for k in self._states if k[1] == request_id]:
            del self._states[key]

    def __len__(self) -> int:
        return len(self._states)
