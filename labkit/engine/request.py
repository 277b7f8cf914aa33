"""A request as the engine tracks it: one model call from arrival to last token.

The token accounting follows vLLM. A request's stream is its prompt followed by the
tokens generated so far (``num_tokens``). ``num_computed_tokens`` of them have KV in
the cache. Each step the scheduler asks the model to compute some of the rest:

- while the prompt is being prefilled, a chunk of it;
- once only the last sampled token lacks KV, a *decode* step: that token, plus
  ``num_speculative_tokens`` draft tokens to verify. Of those, ``accepted`` tokens
  survive (1 to 1 + drafts); the stream grows by that many.

A request that computes the last pending token of its stream samples the next one.
After preemption (recompute) its KV is dropped and ``num_computed_tokens`` returns to
0; the prompt *and* the tokens generated so far are recomputed, mostly from the
prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from labkit.engine.itl_stats import TokenGaps


class Status(Enum):
    PENDING = "pending"  # known, not yet arrived (e.g. a forked child in its delay)
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    session_id: str
    num_prompt_tokens: int
    max_output_tokens: int
    arrival_s: float  # the call's, as its client sees it (TTFT and E2EL count from it)
    kind: str = "main"
    parent_id: str | None = None
    priority: int = 0
    keys: Any = None  # TraceBlockKeys (or None: never cached)
    prefix_hint: Any = None  # PrefixHint left by the previous call of the session
    max_tokens: int = 0  # upper bound of the stream, drafts included (table capacity)
    trace: Any = None  # the TraceRequest it replays, if any
    # ---- progress
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    rank: int = -1
    forked_tokens: int = 0  # tokens adopted from the parent's blocks at fork time
    pending_copies: list = field(default_factory=list)  # copy-on-write (src, dst) pairs
    seq: int = 0  # arrival order, the tie-breaker of every queue
    prompt_token_ids: list | None = None  # real tokens (compute plane); None in simulation
    output_token_ids: list = field(default_factory=list)  # generated tokens (compute plane)
    kv_ready_s: float = 0.0  # while its prefix KV is fetched from another rank: when done
    num_fetched_tokens: int = 0  # prefix tokens fetched from another rank's cache
    num_offload_tokens: int = 0  # prefix tokens loaded from the node's offload tiers
    num_transferred_tokens: int = 0  # prompt KV received from a prefill pool (P/D)
    # when it reached the router of the engine serving it (what async scheduling's
    # visibility judges): arrival_s, except a P/D hand-over's, which reaches its decode
    # group when its prompt is done (`disagg.py`); -1: arrival_s
    enqueued_s: float = -1.0
    # its prefix KV comes as vLLM's KV connectors pull a P/D hand-over's: the landing is
    # seen a step late under async scheduling, like an arrival (`Scheduler.on_the_wire`)
    async_kv_load: bool = False
    # ---- timings and counters for metrics
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    finish_s: float | None = None
    num_cached_tokens: int = -1  # prefix-cache (or fork) hit at first admission
    num_preemptions: int = 0
    num_computed_prefill_tokens: int = 0  # prompt tokens actually computed, recompute included
    itl: TokenGaps = field(default_factory=TokenGaps)  # gaps between successive emissions

    def __post_init__(self) -> None:
        if not self.max_tokens:
            self.max_tokens = self.num_prompt_tokens + self.max_output_tokens
        if self.enqueued_s < 0:
            self.enqueued_s = self.arrival_s

    @property
    def token_ids(self) -> list:
        """The stream so far: prompt then generated tokens (compute plane)."""
        return list(self.prompt_token_ids or []) + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def num_pending_tokens(self) -> int:
        """Tokens of the stream without KV yet (1 when decoding)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """Only the last sampled token lacks KV: next step verifies drafts."""
        return self.num_output_tokens > 0 and \
            self.num_prompt_tokens + self.num_output_tokens - self.num_computed_tokens == 1

    @property
    def remaining_output_tokens(self) -> int:
        return self.max_output_tokens - self.num_output_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def emit(self, num_tokens: int, t: float) -> bool:
        """Record num_tokens new output tokens at time t; True if this was the first."""
        first = self.num_output_tokens == 0
        self.num_output_tokens += num_tokens
        if first:
            self.first_token_s = t
        else:
            self.itl.append(t - self.last_token_s)
        self.last_token_s = t
        return first
