"""KVPlacementModel: which requests hold how many tokens of KV, and where it came from.

The placement view needs, per request in flight: its DP rank, how many tokens of KV it
holds, where each stretch of that KV came from, and what its latest step computed. All
of it comes from events:

- `RequestTokens` (each step): per running request, its context before the step, the
  tokens the step computed and the tokens with KV after it;
- the sources of a request's prefix, at admission: `CacheHit` (prefix cache), `Forked`
  (a subagent's inherited context), `KVLoaded` (offload tiers), `KVFetched` (another DP
  rank's GPUs) and `KVTransferred` (a P/D prefill group) — everything after them was
  computed here;
- `BlocksFreed`: the request's KV is gone (finished, preempted, sent on).

Like the block-table model it keeps a log, so the state after any step can be rebuilt
(`state_at`); a fast-forwarded decode run announces each of its steps' tokens, so the
state after step k is the same with `sim_fast_forward` on or off.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from labkit.engine.events import (
    BlocksFreed, CacheHit, Forked, KVFetched, KVLoaded, KVTransferred, RequestTokens,
    StepsCompleted,
)
from labkit.widgets.base import EventModel

SOURCES = ("computed", "cached", "forked", "loaded", "transferred")


@dataclass(slots=True)
class HeldKV:
    """One request's KV on its DP rank."""

    rank: int
    held: int = 0  # tokens with KV
    spans: tuple = ()  # ((start, end, source), ...): KV that was not computed here
    step: tuple | None = None  # (step seq, context, new tokens, decode) of its last step

    def sources(self, end: int) -> list[tuple[int, int, str]]:
        """Positions [0, end) as runs of one source each (the rest was computed)."""
        out, pos = [], 0
        for a, b, source in self.spans:
            a, b = max(a, pos), min(b, end)
            if b <= a:
                continue
            if a > pos:
                out.append((pos, a, "computed"))
            out.append((a, b, source))
            pos = b
        if pos < end:
            out.append((pos, end, "computed"))
        return out


class PlacementState(dict):
    """request id -> HeldKV, updated event by event."""

    def __init__(self, block_size: int) -> None:
        super().__init__()
        self.block_size = block_size

    def apply(self, event, column: int = 0, seq: int = 0) -> None:
        if isinstance(event, RequestTokens):
            self._tokens(event, column, seq)
        elif isinstance(event, BlocksFreed):
            self.pop(event.request_id, None)
        elif isinstance(event, CacheHit):
            self[event.request_id] = HeldKV(
                event.rank, spans=((0, len(event.blocks) * self.block_size, "cached"),))
        elif isinstance(event, Forked):
            self[event.child_id] = HeldKV(event.rank, spans=((0, event.num_tokens, "forked"),))
        elif isinstance(event, KVTransferred):
            self._append(event, event.start, "transferred")
        elif isinstance(event, (KVLoaded, KVFetched)):
            self._append(event, None, "loaded" if isinstance(event, KVLoaded) else "transferred")

    def _append(self, event, start: int | None, source: str) -> None:
        kv = self.setdefault(event.request_id, HeldKV(event.rank))
        if start is None:  # right after the prefix cached here
            start = kv.spans[-1][1] if kv.spans else 0
        kv.spans = kv.spans + ((start, start + event.num_tokens, source),)

    def _tokens(self, event: RequestTokens, j: int, seq: int) -> None:
        for i, rid in enumerate(event.request_ids):
            kv = self.get(rid)
            if kv is None:
                kv = self[rid] = HeldKV(int(event.ranks[i]))
            kv.held = int(event.held[j, i])
            kv.step = (seq, int(event.context[j, i]), int(event.num_new[j, i]),
                       bool(event.decode[j, i]))
        # forget requests freed in an earlier step (kept one step for its temporaries)
        for rid in [r for r, kv in self.items()
                    if kv.held == 0 and kv.step is not None and kv.step[0] < seq]:
            del self[rid]


class KVPlacementModel(EventModel):
    kinds = (RequestTokens, CacheHit, Forked, KVLoaded, KVFetched, KVTransferred, BlocksFreed)

    def __init__(self, engine) -> None:
        self.block_size = engine.block_size
        self.live = PlacementState(self.block_size)
        # (step seq, event, column): events between the end of step k and the end of
        # step k+1 belong to k+1; a RequestTokens column j to its own step
        self.log: list[tuple[int, object, int]] = []
        super().__init__(engine)

    def on_event(self, event) -> None:
        if isinstance(event, StepsCompleted):
            return
        if isinstance(event, RequestTokens):
            for j in range(len(event.step_index)):
                seq = self.steps_done + j + 1
                self.log.append((seq, event, j))
                self.live.apply(event, j, seq)
            return
        self.log.append((self.steps_done + 1, event, 0))
        self.live.apply(event, 0, self.steps_done + 1)

    def state_at(self, upto_step: int | None = None) -> tuple[int, PlacementState]:
        """(step, the requests' KV when step `step` had just completed); None: now."""
        if upto_step is None:
            return self.steps_done, self.live
        state = PlacementState(self.block_size)
        stop = bisect.bisect_right(self.log, upto_step, key=lambda entry: entry[0])
        for seq, event, column in self.log[:stop]:
            state.apply(event, column, seq)
        return upto_step, state
