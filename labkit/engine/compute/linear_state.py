"""The recurrent state of linear-attention (KDA) layers, per request, and its snapshots.

A linear-attention layer keeps no per-token KV: each request carries a fixed-size
state (a short-conv history and a `[heads, dk, dv]` matrix) that every token updates.
The state is kept by position — "the state after the first p tokens" — so that a
speculative verify step can store one candidate per draft and the next step simply
reads the state at its context length (the accepted prefix); candidates past it are
dropped. A request that restarts from 0 (preempted, recomputed) starts afresh.

Such a state summarises a whole prefix and cannot be rebuilt from paged blocks. Prefix
caching for a hybrid model therefore needs **snapshots**: copies of the state after a
block boundary, stored under the key of the block that ends there. The control plane
decides where to take them and when they are evicted (`engine/kv/state_snapshots.py`);
here they are real tensors:

- every state that ends exactly on a block boundary is *marked* (kept until the request
  is released), and prompt chunks are cut at the boundaries a snapshot may be taken at
  (`state_marks`), so the state there exists;
- `LinearSnapshots.save` copies a request's marked state into the store when the
  control plane saves a snapshot; `restore` puts it back as the state of a request
  whose prefix hit ends there.
"""

from __future__ import annotations


class LinearStates:
    def __init__(self, block_size: int = 0) -> None:
        self.block_size = block_size
        self._states: dict[tuple[int, str], dict[int, object]] = {}
        self._marked: dict[tuple[int, str], dict[int, object]] = {}  # on block boundaries

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

    def has(self, layer: int, request_id: str, position: int) -> bool:
        return position in self._states.get((layer, request_id), {})

    def peek(self, layer: int, request_id: str, position: int):
        """The state after `position` tokens, if kept (nothing is dropped)."""
        return self._states.get((layer, request_id), {}).get(position)

    def put(self, layer: int, request_id: str, position: int, state) -> None:
        self._states.setdefault((layer, request_id), {})[position] = state
        self.mark(layer, request_id, position, state)

    def marked(self, layer: int, request_id: str, position: int):
        """The state after `position` tokens, a block boundary it passed (or None)."""
        return self._marked.get((layer, request_id), {}).get(position)

    def restore(self, layer: int, request_id: str, position: int, state) -> None:
        """Make `state` the request's state after `position` tokens (a prefix hit, a
        P/D hand-over)."""
        self._states[(layer, request_id)] = {position: state}
        self.mark(layer, request_id, position, state)

    def mark(self, layer: int, request_id: str, position: int, state) -> None:
        """Keep `state` as the one after `position` tokens, if that is a block boundary
        (a snapshot may be taken there later)."""
        if self.block_size and position % self.block_size == 0:
            self._marked.setdefault((layer, request_id), {})[position] = state

    def release(self, request_id: str) -> None:
        for store in (self._states, self._marked):
            for key in [k for k in store if k[1] == request_id]:
                del store[key]

    def __len__(self) -> int:
        return len(self._states)


class LinearSnapshots:
    """One GPU's snapshots: block key -> {layer: state} for the linear layers it holds."""

    def __init__(self, states: LinearStates, layers) -> None:
        self.states = states
        self.layers = sorted(layers)
        self._store: dict[int, dict[int, object]] = {}

    def __contains__(self, key: int) -> bool:
        return key in self._store

    def save(self, key: int, request_id: str, position: int) -> None:
        copies = {}
        for layer in self.layers:
            state = self.states.marked(layer, request_id, position)
            if state is None:
                raise RuntimeError(f"no linear-attention state of {request_id} at the block "
                                   f"boundary {position} (layer {layer}) to snapshot")
            copies[layer] = _copy(state)
        self._store[key] = copies

    def copies(self, key: int) -> dict | None:
        """The snapshot's states by layer (None if not here), to read, not to change."""
        return self._store.get(key)

    def restore(self, key: int, request_id: str, position: int) -> None:
        copies = self._store.get(key)
        if copies is None:
            raise RuntimeError(f"{request_id}: no linear-attention snapshot for its prefix "
                               f"of {position} tokens")
        for layer, state in copies.items():
            self.states.restore(layer, request_id, position, _copy(state))

    def prune(self, alive) -> None:
        """Drop the snapshots the control plane no longer has (`alive(key)` False)."""
        for key in [k for k in self._store if not alive(k)]:
            del self._store[key]

    def __len__(self) -> int:
        return len(self._store)


def _copy(state):
    """A state's own copy (a NamedTuple of tensors, some possibly None)."""
    return type(state)(*(None if t is None else t.clone() for t in state))
