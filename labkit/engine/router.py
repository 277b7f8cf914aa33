"""The router: which DP rank serves an arriving request.

Each DP rank has its own scheduler and its own KV cache, so where a request lands
decides both its queueing delay and whether its prefix is already cached there.

- ``round_robin``: ranks in turn.
- ``least_loaded``: fewest ``waiting * 4 + running`` (vLLM's DP load balancer).
- ``least_kv``: lowest KV-cache usage.
- ``least_running_tokens``: fewest tokens in flight (contexts of running requests
  plus prompts waiting), a proxy for the attention work a rank has queued.
- ``session_sticky``: every call of a session goes where its first call went (chosen
  least-loaded), so the session's KV is always reused — at the price of imbalance.
- ``prefix_aware``: the rank holding the longest cached prefix of the prompt, unless
  that would make the load too uneven (SGLang's cache-aware router does the same).

Ties break towards the lower rank, so routing is deterministic.
"""

from __future__ import annotations

from labkit.engine.events import EventBus, RequestRouted
from labkit.errors import unknown_choice
from labkit.specs.config import ROUTER_POLICIES


class Router:
    # prefix_aware falls back to least_loaded when loads differ by more than this.
    BALANCE_THRESHOLD = 8
    # a waiting request weighs this many running ones in a rank's load (vLLM's DP balancer)
    WAITING_WEIGHT = 4

    def __init__(self, policy: str, schedulers: list, events: EventBus) -> None:
        if policy not in ROUTER_POLICIES:
            raise unknown_choice("router policy", policy, ROUTER_POLICIES)
        self.policy = policy
        self.schedulers = schedulers
        self.events = events
        self._next = 0
        self._home: dict[str, int] = {}

    @property
    def reads_progress(self) -> bool:
        """Does routing weigh state that changes as steps play (KV in use, tokens in
        flight, cached prefixes), not only queue lengths?"""
        return self.policy in ("least_kv", "least_running_tokens", "prefix_aware")

    def loads(self) -> list[int]:
        """Each rank's load: waiting requests weighted `WAITING_WEIGHT`, plus running ones
        (all at once: routing weighs every rank at each arrival)."""
        w = self.WAITING_WEIGHT
        return [w * len(s.waiting) + len(s.running) for s in self.schedulers]

    def tokens_in_flight(self, rank: int) -> int:
        s = self.schedulers[rank]
        return (sum(r.num_tokens for r in s.running)
                + sum(r.num_tokens for r in s.waiting))

    def route(self, req, now: float) -> int:
        n = len(self.schedulers)
        scores = None
        if n == 1:
            rank = 0
        elif self.policy == "round_robin":
            rank = self._next % n
            self._next += 1
        elif self.policy == "least_loaded":
            scores = self.loads()
            rank = _argmin(scores)
        elif self.policy == "least_kv":
            scores = [self.schedulers[r].kv.pool.num_used for r in range(n)]
            rank = _argmin(scores)
        elif self.policy == "least_running_tokens":
            scores = [self.tokens_in_flight(r) for r in range(n)]
            rank = _argmin(scores)
        elif self.policy == "session_sticky":
            rank = self._home.get(req.session_id, -1)
            if rank < 0:
                scores = self.loads()
                rank = self._home[req.session_id] = _argmin(scores)
        else:
            rank, scores = self._prefix_aware(req)
        if self.events.wants(RequestRouted):
            self.events.emit(RequestRouted(now, req.request_id, rank, self.policy, scores))
        return rank

    def _prefix_aware(self, req) -> tuple[int, list]:
        loads = self.loads()
        if max(loads) - min(loads) > self.BALANCE_THRESHOLD:
            return _argmin(loads), loads
        matched = [s.kv.lookup(req).num_tokens for s in self.schedulers]
        scores = [(-m, load) for m, load in zip(matched, loads)]
        return _argmin(scores), scores


def _argmin(values: list) -> int:
    return min(range(len(values)), key=values.__getitem__)
