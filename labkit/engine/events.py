"""The event stream: every state change of the engine, as a typed event.

The engine never imports a widget or a metrics table. Instead, each component
announces what it did on an `EventBus` — a block was allocated, a request was routed,
a step finished on rank 3 — and anything that wants to watch *subscribes*. Metrics,
notebook widgets and exporters are all subscribers.

Subscribing costs nothing when nobody listens: emitters ask `bus.wants(EventType)`
(a set lookup) before they even build an event, so a replay with no block-level
subscriber never creates a single block event.

Time stamps are simulated seconds. Events of one instance arrive in causal order;
when fast-forward simulates a run of steps at once, the step and block events of that
run carry the exact time stamps of their steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np


@dataclass(slots=True)
class Event:
    kind: ClassVar[str] = "event"
    t: float


# ------------------------------------------------------------------ requests
@dataclass(slots=True)
class RequestArrived(Event):
    kind: ClassVar[str] = "request_arrived"
    request_id: str
    session_id: str


@dataclass(slots=True)
class RequestRouted(Event):
    kind: ClassVar[str] = "request_routed"
    request_id: str
    rank: int
    policy: str
    scores: list | None = None  # per-rank scores the policy compared (lower is better)


@dataclass(slots=True)
class RequestScheduled(Event):
    """A request was admitted from the waiting queue (first time or after preemption)."""

    kind: ClassVar[str] = "request_scheduled"
    request_id: str
    rank: int
    num_cached_tokens: int  # served by the prefix cache or a fork
    num_prompt_tokens: int


@dataclass(slots=True)
class RequestPreempted(Event):
    kind: ClassVar[str] = "request_preempted"
    request_id: str
    rank: int
    num_computed_tokens: int  # thrown away, to be recomputed


@dataclass(slots=True)
class FirstToken(Event):
    kind: ClassVar[str] = "first_token"
    request_id: str
    rank: int


@dataclass(slots=True)
class RequestFinished(Event):
    kind: ClassVar[str] = "request_finished"
    request: Any  # the engine's Request, with all its timings


# --------------------------------------------------------------------- steps
@dataclass(slots=True)
class StepStarted(Event):
    """An instance began a step — or, fast-forwarding, a run of `steps` decode steps
    (`end` is when it is planned to finish; an arrival may cut a run short)."""

    kind: ClassVar[str] = "step_started"
    instance: int
    ranks: list[int]
    step_index: int  # index of the first step
    steps: int
    end: float
    requests: list[list[str]]  # per rank, the requests computing in it


@dataclass(slots=True)
class StepsCompleted(Event):
    """One or more consecutive steps of one instance, column by column.

    Arrays have shape (steps, ranks): `start` is the start of each step, `duration` its
    length (the same for all ranks of a lockstep instance), `busy` what each rank's
    own work took (`compute` + `comm` + overhead) and `stall` how long it waited for
    the slowest rank.
    """

    kind: ClassVar[str] = "steps_completed"
    instance: int
    ranks: list[int]
    step_index: np.ndarray  # (steps,)
    start: np.ndarray  # (steps,)
    duration: np.ndarray  # (steps,)
    busy: np.ndarray  # (steps, ranks)
    stall: np.ndarray
    compute: np.ndarray
    comm: np.ndarray
    num_prefill_reqs: np.ndarray
    num_decode_reqs: np.ndarray
    prefill_tokens: np.ndarray
    decode_tokens: np.ndarray
    kv_used_blocks: np.ndarray
    kv_total_blocks: np.ndarray  # (ranks,)
    persistent_kv_bytes: np.ndarray  # per GPU of the rank: KV held in blocks
    temporary_kv_bytes: np.ndarray  # per GPU of the rank: gathered/broadcast KV in flight


@dataclass(slots=True)
class RequestTokens(Event):
    """Per request, where its tokens stood in each of one or more consecutive steps of
    an instance (columns as in StepsCompleted, emitted just before it).

    Arrays have shape (steps, requests): `context` is the tokens with KV before the
    step, `num_new` the tokens the step computed for it (0: it waited, e.g. for KV on
    the wire), `decode` whether those were decode tokens, `held` the tokens whose KV
    it holds after the step (0 once its blocks are freed). Requests are those running
    on the instance's ranks (`ranks[i]` is request i's DP rank).
    """

    kind: ClassVar[str] = "request_tokens"
    instance: int
    step_index: np.ndarray  # (steps,)
    request_ids: list[str]
    ranks: np.ndarray  # (requests,)
    context: np.ndarray  # (steps, requests)
    num_new: np.ndarray
    decode: np.ndarray
    held: np.ndarray


# -------------------------------------------------------------------- blocks
@dataclass(slots=True)
class BlocksAllocated(Event):
    kind: ClassVar[str] = "blocks_allocated"
    rank: int
    request_id: str
    blocks: np.ndarray  # physical ids, in block-table order


@dataclass(slots=True)
class BlocksFreed(Event):
    kind: ClassVar[str] = "blocks_freed"
    rank: int
    request_id: str
    blocks: np.ndarray


@dataclass(slots=True)
class WindowSlid(Event):
    """Sliding-window layers: a request's pages of blocks its next queries no longer
    read went back to the pool (`kv/sliding_window.py`), oldest first."""

    kind: ClassVar[str] = "window_slid"
    rank: int
    request_id: str
    blocks: np.ndarray


@dataclass(slots=True)
class BlocksCached(Event):
    """Full blocks got their prefix-cache key and can now be hit."""

    kind: ClassVar[str] = "blocks_cached"
    rank: int
    request_id: str
    blocks: np.ndarray
    keys: np.ndarray


@dataclass(slots=True)
class BlocksEvicted(Event):
    """Cached free blocks were reused; their keys are gone from the cache."""

    kind: ClassVar[str] = "blocks_evicted"
    rank: int
    blocks: np.ndarray


@dataclass(slots=True)
class CacheHit(Event):
    kind: ClassVar[str] = "cache_hit"
    rank: int
    request_id: str
    blocks: np.ndarray  # physical blocks whose KV the request reuses


@dataclass(slots=True)
class Forked(Event):
    kind: ClassVar[str] = "forked"
    rank: int
    parent_id: str
    child_id: str
    blocks: np.ndarray  # shared physical blocks
    num_tokens: int


@dataclass(slots=True)
class KVFetched(Event):
    """A call routed away from the rank holding its session's KV: that prefix is
    copied over from `src_rank` (blocks on `rank` held meanwhile)."""

    kind: ClassVar[str] = "kv_fetched"
    rank: int
    request_id: str
    src_rank: int
    num_tokens: int
    seconds: float


@dataclass(slots=True)
class KVTransferred(Event):
    """P/D disaggregation: a call's prompt KV from position `start` (what the decode
    group did not cache) to `start + num_tokens` came over the network from the
    prefill group that computed it, into `rank`'s blocks; it lands `seconds` later."""

    kind: ClassVar[str] = "kv_transferred"
    rank: int
    request_id: str
    start: int
    num_tokens: int
    seconds: float


@dataclass(slots=True)
class KVOffloaded(Event):
    """Newly cached blocks were written through to node `store`'s host tier; full tiers
    moved their victims down (`num_demoted`) or let them go (`num_dropped`)."""

    kind: ClassVar[str] = "kv_offloaded"
    store: int
    num_stored: int
    num_demoted: int
    num_dropped: int


@dataclass(slots=True)
class KVLoaded(Event):
    """A call's prefix continues in the node's offload tiers: `num_tokens` of it are
    loaded to `rank`'s GPUs (`tokens_by_tier`, e.g. {"cpu": 256, "disk": 64}) into its
    GPU `blocks`, each from the tier `block_tiers` names; it can compute `seconds` from
    now."""

    kind: ClassVar[str] = "kv_loaded"
    rank: int
    request_id: str
    num_tokens: int
    tokens_by_tier: dict
    seconds: float
    blocks: np.ndarray = None
    block_tiers: tuple = ()


@dataclass(slots=True)
class KVLoadDeclined(Event):
    """The tiers hold `num_tokens` more of a call's prefix, but recomputing them
    (`recompute_s`, the cost model's estimate) is quicker than loading (`load_s`)."""

    kind: ClassVar[str] = "kv_load_declined"
    rank: int
    request_id: str
    num_tokens: int
    load_s: float
    recompute_s: float


@dataclass(slots=True)
class CopyOnWrite(Event):
    kind: ClassVar[str] = "copy_on_write"
    rank: int
    request_id: str
    src_block: int
    dst_block: int


# ----------------------------------------------------------------------- bus
Callback = Callable[[Event], None]


@dataclass(slots=True)
class Subscription:
    bus: EventBus
    callback: Callback
    kinds: tuple[type, ...] | None

    def unsubscribe(self) -> None:
        self.bus.unsubscribe(self)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc) -> None:
        self.unsubscribe()


@dataclass(slots=True)
class EventBus:
    _by_kind: dict[type, list[Subscription]] = field(default_factory=dict)
    _everything: list[Subscription] = field(default_factory=list)
    _wanted: set[type] = field(default_factory=set)

    def subscribe(self, callback: Callback, *kinds: type) -> Subscription:
        """Call `callback(event)` for events of these types (all types if none given)."""
        sub = Subscription(self, callback, kinds or None)
        if kinds:
            for kind in kinds:
                self._by_kind.setdefault(kind, []).append(sub)
        else:
            self._everything.append(sub)
        self._refresh()
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        if sub.kinds is None:
            if sub in self._everything:
                self._everything.remove(sub)
        else:
            for kind in sub.kinds:
                subs = self._by_kind.get(kind, [])
                if sub in subs:
                    subs.remove(sub)
                if not subs:
                    self._by_kind.pop(kind, None)
        self._refresh()

    def _refresh(self) -> None:
        self._wanted = set(self._by_kind)

    def wants(self, kind: type) -> bool:
        """True if anyone listens to `kind`; emitters check this before building events."""
        return bool(self._everything) or kind in self._wanted

    def emit(self, event: Event) -> None:
        for sub in self._by_kind.get(type(event), ()):
            sub.callback(event)
        for sub in self._everything:
            sub.callback(event)
