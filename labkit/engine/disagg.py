"""Prefill/decode disaggregation: two pools of one model on one virtual clock.

A *prefill* pool computes each call's prompt KV; the call then moves to a *decode*
pool, which receives that KV over the network (NIXL-like: each GPU its own NIC,
bandwidth-bound) and generates the output, its first token included. Each pool has
its own layout and size — typically a token-sharded prefill (PCP, DCP) that finishes
long prompts fast and a paged decode (DP, DEP) that holds many calls' KV. Neither
role's steps are disturbed by the other's work.

`PDEngine` holds `num_prefill` prefill groups and `num_decode` decode groups, each a
plain `Engine` (its own schedulers, KV managers, data plane), and interleaves their
events by time. A call goes:

1. **to a prefill group**, prefix-aware: the one whose prefix cache holds the most of
   the prompt (unless loads differ a lot) — so a session's later calls find their
   context there. It runs as a call with one output token, which nobody sees (vLLM's
   proxy drops it). Its blocks stay held when it finishes: the KV still has to be sent.
2. **to a decode group**, session-sticky: the group that decoded the session's
   previous call still caches its prompt and output, so only the new part of the
   prompt crosses the network — prefix reuse survives the conversion. The decode
   scheduler admits it like a fetched prefix (`transfer.py`): the call holds its
   blocks and waits for the transfer, other calls keep decoding. It sees the call, and
   later its landed KV, as vLLM's decode engine does under async scheduling: a step
   late when busy (`Request.enqueued_s`, `async_kv_load`; docs/disagg.md).
3. The transfer moves the prompt tokens the decode group lacks: each prefill GPU sends
   its shard, each decode GPU receives its own share, and the decode side rewrites
   the token-sharded layout into its paged one (a pass over HBM). On the compute
   plane the bytes really move: the prefill side's plane exports them (`ExportKV`, a
   step command; its bytes come back in a report) and the decode side's imports them
   (`ImportKV`), `compute/kv_convert.py` doing the conversion on the planes. Once the
   copy has landed the prefill blocks are released (into the prefill prefix cache).
4. **The first token is the decode side's.** As in vLLM, the decode group holds all of
   the prompt but its last token once the KV lands, computes that token in its first
   step and samples the call's first token there: a P/D call's TTFT runs through the
   prefill, the transfer, the decode side's lag and one decode step. A model with
   linear-attention layers prefills all but the last token on the prefill side, so
   that its recurrent state crosses where the decode side goes on from.

The two layouts must agree on what a KV block is: the same block size and KV dtype
(see `check_pd_pair`); anything else is converted.

Fast-forward (`decode_run.py`) is exact here too (`tests/engine/test_pd_fast_forward.py`):
a hand-over cuts the decode run it joins where its scheduler first sees it, and the steps
from its KV's landing until one takes the landed blocks into the prefix cache are single.
"""

from __future__ import annotations

import heapq
import math
import os
from collections.abc import Callable

import numpy as np
import pandas as pd

from labkit.engine.arrivals import Arrivals
from labkit.engine.engine import Engine
from labkit.engine.events import EventBus, KVTransferred
from labkit.engine.metrics import ReplayResult
from labkit.engine.request import Request, Status
from labkit.engine.step_io import ExportKV, ImportKV, KVExported, KVSpan
from labkit.engine.transfer import PrefixTransfer
from labkit.errors import ConfigError
from labkit.specs.layout import MAX_GPUS, Layout

PD_TRANSFER_LATENCY_S = 100e-6  # RDMA set-up and the first bytes of one call's KV
PD_LINK_EFFICIENCY = 0.8
_BALANCE = 8  # prefix-aware routing falls back to the least loaded beyond this


class PDEngine(Arrivals):
    def __init__(self, model="llama-3.1-8b", prefill_layout="tp1", decode_layout="tp1",
                 hardware="h200", num_prefill: int = 1, num_decode: int = 1,
                 backend: str = "sim", cost_model=None, *, prefill_knobs: dict | None = None,
                 decode_knobs: dict | None = None, **knobs) -> None:
        """`knobs` (EngineConfig names) apply to both roles; `prefill_knobs` /
        `decode_knobs` override them for one role (e.g. num_speculative_tokens for
        decode only). `backend="compute"` also takes device/dtype/clock via knobs."""
        super().__init__()  # the P/D router's arrivals (`arrivals.py`)
        for name, n in (("num_prefill", num_prefill), ("num_decode", num_decode)):
            if not isinstance(n, int) or n < 1:
                raise ConfigError(f"{name}={n!r} must be an integer >= 1")
        check_pd_size(Layout.parse(prefill_layout), Layout.parse(decode_layout), num_prefill,
                      num_decode)
        p_knobs = {**knobs, **(prefill_knobs or {})}
        d_knobs = {**knobs, **(decode_knobs or {})}
        if backend == "compute":  # (elsewhere Engine refuses the executor knob)
            check_pd_processes([(Layout.parse(prefill_layout), num_prefill, p_knobs),
                                (Layout.parse(decode_layout), num_decode, d_knobs)])
        # a prefill group holds a finished call's KV until it is sent; a decode group
        # asks for the prompt KV a prefill group holds before its own prefix sources
        self.prefill = [Engine(model, prefill_layout, hardware, backend, cost_model,
                               hold_kv_on_finish=True,
                               **{**p_knobs, "router": p_knobs.get("router", "prefix_aware")})
                        for _ in range(num_prefill)]
        self.decode = [Engine(model, decode_layout, hardware, backend, cost_model,
                              prefix_sources=[lambda _engine: self._offer_handoff],
                              **{**d_knobs, "router": d_knobs.get("router", "session_sticky")})
                       for _ in range(num_decode)]
        check_pd_pair(self.prefill[0], self.decode[0])
        first = self.decode[0]
        self.model, self.hardware, self.backend = first.model, first.hardware, backend
        self.tokenizer = first.tokenizer
        self.config, self.block_size = first.config, first.block_size
        self.layout = _PDLayout(self.prefill[0].layout.text, num_prefill,
                                first.layout.text, num_decode)
        self.events = EventBus()  # P/D-level events; each group has its own bus too
        self.step_recorder = _Steps(self)
        for e in self.prefill:
            e.finish_callbacks.append(self._prefilled)
        for e in self.decode:
            e.finish_callbacks.append(self._decoded)
        self.now = 0.0
        self.stop_s = math.inf
        self.requests: dict[str, Request] = {}
        self.finish_callbacks: list[Callable[[Request, float], None]] = []
        self._shadow: dict[str, Request] = {}  # request id -> its prefill-side call
        self._prefill_of: dict[str, Engine] = {}
        self._decode_of: dict[str, Engine] = {}
        self._prefilled_calls: dict[str, Request] = {}  # prompt done and sent: for results
        self._home: dict[str, int] = {}  # session -> decode group
        self.transfers: list[dict] = []  # one row per P->D transfer
        self._landings: list = []  # (time, seq, request id): the prefill KV freed then

    # ------------------------------------------------------------- set-up
    @property
    def gpus(self) -> int:
        return sum(e.gpus for e in self.prefill + self.decode)

    @property
    def running_slots(self) -> int:
        """Calls that can run at once: the decode groups' slots (each call ends there)."""
        return sum(e.running_slots for e in self.decode)

    @property
    def num_blocks_per_rank(self) -> int:
        return self.decode[0].num_blocks_per_rank

    def check_fits(self, request_id: str, input_tokens: int, output_tokens: int) -> None:
        self.prefill[0].check_fits(request_id, input_tokens, 1)
        self.decode[0].check_fits(request_id, input_tokens, output_tokens)

    def close(self) -> None:
        """Close every group's engine (`Engine.close`)."""
        for e in self._engines():
            e.close()

    # ------------------------------------------------------------ running
    def _engines(self) -> list[Engine]:
        return self.prefill + self.decode

    def _next(self) -> tuple[float, Engine | str | None]:
        """When the next event happens, and in which group (None: a P/D arrival, which
        goes first on a tie; then "landing": a hand-over's KV landed, its prefill blocks
        are freed)."""
        t = self._arrivals[0][0] if self._arrivals else math.inf
        source = None
        if self._landings and self._landings[0][0] < t:
            t, source = self._landings[0][0], "landing"
        for e in self._engines():
            te = e.next_event_time()
            if te < t:
                t, source = te, e
        return t, source

    def next_event_time(self) -> float:
        return self._next()[0]

    def has_events(self, before: float | None = None) -> bool:
        return self.next_event_time() < (self.stop_s if before is None else before)

    @property
    def computes(self) -> bool:
        return self.decode[0].computes

    def step(self) -> bool:
        """Process events, in time order across all groups, up to the next committed
        step of any group. False when nothing is left before `stop_s`."""
        while True:
            t, engine = self._next()
            if t >= self.stop_s or t == math.inf:
                for e in self._engines():  # the data planes catch up
                    e.flush_commands()
                return False
            self.now = t
            if engine is None:
                self._route(heapq.heappop(self._arrivals)[2])
                continue
            if engine == "landing":
                self._release_prefill(heapq.heappop(self._landings)[2], t)
                continue
            engine.stop_s = self.stop_s
            if engine.process_event() == "commit":
                return True

    def run_until(self, t: float = math.inf) -> None:
        self.stop_s = t
        while self.step():
            pass

    # ------------------------------------------------------------ the flow
    def _route(self, req: Request) -> None:
        """Arrival: the prompt goes to a prefill group (prefix-aware)."""
        loads = [sum(e.router.loads()) for e in self.prefill]
        if max(loads) - min(loads) > _BALANCE:
            g = loads.index(min(loads))
        else:
            hits = [max(s.kv.lookup(req).num_tokens for s in e.schedulers) for e in self.prefill]
            g = min(range(len(self.prefill)), key=lambda i: (-hits[i], loads[i]))
        n = self._prefilled_tokens(req)
        # token keys grow with the tokens a side samples: the prefill side's own copy, so
        # the token it samples (and drops) never enters the call's
        keys = req.keys.head(n) if hasattr(req.keys, "extend") else req.keys
        shadow = Request(request_id=req.request_id, session_id=req.session_id,
                         num_prompt_tokens=n, max_output_tokens=1,
                         arrival_s=req.arrival_s, kind=req.kind, parent_id=req.parent_id,
                         priority=req.priority, keys=keys, trace=req.trace)
        if req.prompt_token_ids is not None:
            shadow.prompt_token_ids = req.prompt_token_ids[:shadow.num_prompt_tokens]
        self._shadow[req.request_id] = shadow
        self._prefill_of[req.request_id] = self.prefill[g]
        self.prefill[g].submit(shadow, at=self.now)

    def _prefilled_tokens(self, req: Request) -> int:
        """How much of the prompt the prefill side computes: all of it, but for a model
        with linear-attention layers all but the last token (see the module docstring)."""
        if self.model.linear_layers and req.num_prompt_tokens > 1:
            return req.num_prompt_tokens - 1
        return req.num_prompt_tokens

    def _prefilled(self, shadow: Request, t: float) -> None:
        """A prompt is computed (its sampled token is dropped): on to a decode group."""
        req = self.requests[shadow.request_id]
        req.first_scheduled_s = shadow.first_scheduled_s
        g = self._home.get(req.session_id)
        if g is None:
            loads = [self._decode_load(e) for e in self.decode]
            g = self._home[req.session_id] = loads.index(min(loads))
        arrival = req.arrival_s
        req.forked_tokens = 0  # the prefix comes over the network or from the decode cache
        self._decode_of[req.request_id] = self.decode[g]
        # it reaches the decode group now (`enqueued_s`), a newcomer its scheduler sees as
        # it sees any (async scheduling: from the step after next when busy)...
        self.decode[g].submit(req, at=t)
        req.arrival_s = arrival  # ...the call's own arrival stays, for TTFT and E2EL

    @staticmethod
    def _decode_load(group: Engine) -> int:
        """A decode group's load as its router weighs it, counting the hand-overs on
        their way there as waiting: calls prefilled in one step are all sent before any
        arrives, and would otherwise all pick the same group."""
        queued = sum(group.router.loads())
        return queued + group.router.WAITING_WEIGHT * group.num_pending

    def _offer_handoff(self, req: Request, cached: int, now: float) -> PrefixTransfer | None:
        """Decode admission (a prefix source): the prompt KV the prefill group holds."""
        shadow = self._shadow.get(req.request_id)
        if shadow is None:
            return None
        # all of the prompt but its last token, which the decode side computes (vLLM's
        # `_update_waiting_for_remote_kv` takes one token off a fully loaded prompt)
        tokens = min(shadow.num_prompt_tokens, req.num_prompt_tokens - 1)
        if tokens <= cached:  # the decode group caches it all already
            self._release_prefill(req.request_id, now)
            return None
        prefill = self._prefill_of[req.request_id]
        decode = self._decode_of[req.request_id]
        seconds = transfer_seconds(prefill, decode, tokens - cached)

        def admit(r: Request, now: float) -> float:
            r.num_transferred_tokens = tokens - cached
            r.async_kv_load = True  # its landing is seen as vLLM's NIXL reads are
            if decode.events.wants(KVTransferred):
                decode.events.emit(KVTransferred(now, r.rank, r.request_id, cached,
                                                 tokens - cached, seconds))
            if decode.computes:  # the bytes really move
                self._copy_kv(prefill, shadow, decode, r, cached, tokens)
            self.transfers.append({"request_id": r.request_id, "start_s": now,
                                   "seconds": seconds, "tokens": tokens - cached,
                                   "decode_cached_tokens": cached})
            # the prefill blocks stay held until the copy has landed (vLLM frees them when
            # the decode side's read is done)
            heapq.heappush(self._landings, (now + seconds, r.seq, r.request_id))
            return seconds
        return PrefixTransfer(tokens, seconds, admit)

    def _copy_kv(self, prefill: Engine, shadow: Request, decode: Engine, req: Request,
                 start: int, stop: int) -> None:
        """The hand-over as two commands: the prefill side's plane exports the KV (and a
        hybrid model's state) at once, its bytes come back in a report, and the decode
        side's plane imports them with its next step (`step_io.ExportKV` / `ImportKV`)."""
        src_kv = prefill.schedulers[shadow.rank].kv
        dst_kv = decode.schedulers[req.rank].kv
        spec = prefill.model
        src, dst = [], []  # the spans of positions that cross, on each side's tables
        full = None
        if spec.sliding_window_layers:  # their KV crosses for the decode side's window only
            window = list(spec.sliding_window_layers)
            full = [i for i in range(spec.num_layers)
                    if not spec.is_linear_layer(i) and i not in window]
            first = max(start, dst_kv.window.first_needed(stop) * decode.block_size)
            src.append(KVSpan(_ids(src_kv.window_table(shadow.request_id)), first, stop, window))
            dst.append(KVSpan(_ids(dst_kv.window_table(req.request_id)), first, stop, window))
        src.append(KVSpan(_ids(src_kv.table(shadow.request_id)), start, stop, full))
        dst.append(KVSpan(_ids(dst_kv.table(req.request_id)), start, stop, full))
        state = stop if spec.linear_layers else None  # the state crosses whole
        # (and the state at its last block boundary, where a decode side with snapshots
        # saves one if the call ends before the next: `KVManager.free`)
        prefill.outbox.send(ExportKV(req.request_id, shadow.rank, req.request_id, src, state,
                                     state_boundary=dst_kv.snapshots is not None))
        prefill.flush_commands()  # now: its bytes go into the decode side's import
        sent = [r for r in prefill.outbox.take_reports(KVExported)
                if r.transfer == req.request_id]
        decode.outbox.send(ImportKV(req.rank, req.request_id, dst, sent[-1].payload, state))

    def _release_prefill(self, request_id: str, now: float) -> None:
        shadow = self._shadow.pop(request_id, None)
        if shadow is not None:
            engine = self._prefill_of.pop(request_id)
            engine.schedulers[shadow.rank].kv.free(shadow)
            engine.release(request_id)  # its per-request state on the data plane, if any
            engine.kv_released(shadow.rank, now)
            self._prefilled_calls[request_id] = shadow

    def _decoded(self, req: Request, t: float) -> None:
        self._finish(req, t)

    def _finish(self, req: Request, t: float) -> None:
        self._decode_of.pop(req.request_id, None)
        shadow = self._prefilled_calls.pop(req.request_id, None)
        if shadow is not None:  # the call's prompt work happened on the prefill side
            req.num_cached_tokens = shadow.num_cached_tokens
            req.num_computed_prefill_tokens += shadow.num_computed_prefill_tokens
            req.num_preemptions += shadow.num_preemptions
        req.status, req.finish_s = Status.FINISHED, t
        for callback in self.finish_callbacks:
            callback(req, t)

    # ------------------------------------------------------------ results
    def extra_summary(self) -> dict:
        """The groups' optional-mechanism counters (offload tiers, state snapshots)."""
        out: dict = {}
        for e in self._engines():
            for key, value in e.extra_summary().items():
                out[key] = out.get(key, 0) + value
        return out

    def replay(self, trace, concurrency: int | None = None, duration_s: float | None = None,
               open_loop: bool = False, **options) -> ReplayResult:
        from labkit.engine.replay import replay

        return replay(self, trace, concurrency=concurrency, duration_s=duration_s,
                      open_loop=open_loop, **options)

    def result(self, warmup_s: float = 0.0, wall_s: float = 0.0) -> ReplayResult:
        from labkit.engine.metrics import collect_result

        return collect_result(self, warmup_s=warmup_s, end_s=max(self.now, warmup_s),
                              wall_s=wall_s)


def _ids(table) -> np.ndarray:
    """A block table copied for a message (the KV manager's stays its own)."""
    return np.array(table, dtype=np.int64)


def transfer_seconds(prefill: Engine, decode: Engine, tokens: int) -> float:
    """Time to move `tokens` of one call's KV from a prefill group to a decode group:
    the prefill GPUs share the sending (one copy of the KV, each GPU its NIC), each
    decode GPU receives its own share, then rewrites it into its paged layout.
    Sliding-window layers send only the window at the end (the decode side's queries
    read nothing older)."""
    if tokens <= 0:
        return 0.0
    hw, m = decode.hardware, decode.model
    if m.sliding_window_layers:  # window layers cost what full ones do per token
        tokens_kv = tokens + min(tokens, m.sliding_window) * (
            m.num_sliding_layers / m.num_full_attention_layers)
    else:
        tokens_kv = tokens
    one_copy = tokens_kv * prefill.placement.kv_bytes_per_token()
    send = one_copy / (prefill.layout.gpus_per_replica * prefill.hardware.internode_bandwidth)
    per_decode_gpu = tokens_kv * decode.placement.kv_bytes_per_token_per_gpu()
    receive = per_decode_gpu / hw.internode_bandwidth
    convert = 2 * per_decode_gpu / hw.hbm_bandwidth  # read the landed shard, write pages
    blocks = -(-tokens // decode.block_size)
    issue = max(prefill.block_layout.copy_overhead_s(blocks),  # descriptors, each side
                decode.block_layout.copy_overhead_s(blocks))
    return PD_TRANSFER_LATENCY_S + max(send, receive) / PD_LINK_EFFICIENCY + convert + issue


def check_decode_layout(layout, where: str) -> None:
    """A decode layout cannot split the prompt by tokens (PCP is for prefill)."""
    if layout.pcp > 1:
        raise ConfigError(f"{where}: a decode layout cannot split the prompt by tokens "
                          f"(pcp{layout.pcp}); PCP is a prefill layout — use DCP, TP, DP "
                          f"or DEP for decode")


def check_pd_size(prefill_layout, decode_layout, num_prefill: int, num_decode: int) -> None:
    """Refuse a P/D system larger than any deployment labkit simulates (MAX_GPUS)."""
    gpus = num_prefill * prefill_layout.gpus + num_decode * decode_layout.gpus
    if gpus > MAX_GPUS:
        raise ConfigError(f"P:D ratio {num_prefill}:{num_decode} needs {gpus:,} GPUs "
                          f"({num_prefill} x {prefill_layout.text} + {num_decode} x "
                          f"{decode_layout.text}); labkit simulates at most {MAX_GPUS:,}")


def check_pd_processes(roles) -> None:
    """executor='mp' under torchrun: the launched world is one engine's (its RANK 0, the
    driver, hosts that engine's GPU 0), so at most one group of the system may span
    several GPUs there; a one-GPU group needs none (its GPU lives in the driver).
    Spawned (no torchrun), every group of several GPUs gets a world of its own
    (mp_executor.py), so any number run as processes. `roles`: (layout, number of
    groups, knobs) per role."""
    if not all(k in os.environ for k in ("RANK", "WORLD_SIZE")):  # not under torchrun
        return
    spread = [(layout.text, n) for layout, n, knobs in roles
              if knobs.get("executor") == "mp" and layout.gpus > 1]
    if sum(n for _, n in spread) > 1:
        which = " + ".join(f"{n} x {text}" for text, n in spread)
        raise ConfigError(f"executor='mp' under torchrun: {which} groups of several GPUs "
                          "would each need the launched torch.distributed world; at most one "
                          "may run as processes there (give the others executor='threads' "
                          "through prefill_knobs / decode_knobs, or run without torchrun)")


def check_pd_pair(prefill: Engine, decode: Engine) -> None:
    """Refuse, before anything runs, a prefill and a decode deployment whose KV cannot
    be handed from one to the other."""
    p, d = prefill, decode
    where = f"P/D pair prefill {p.layout.text!r} -> decode {d.layout.text!r}"
    if p.block_size != d.block_size:
        raise ConfigError(f"{where}: block_size differs ({p.block_size} vs {d.block_size}); "
                          f"both roles must page KV alike")
    if p.config.kv_dtype() != d.config.kv_dtype():
        raise ConfigError(f"{where}: kv_cache_dtype differs ({p.config.kv_dtype()} vs "
                          f"{d.config.kv_dtype()}); the decode side would need a requantising "
                          f"pass labkit does not model")
    check_decode_layout(d.layout, where)
    if p.data_plane.computes and p.model.linear_layers and \
            d.config.enable_prefix_caching and not p.config.enable_prefix_caching:
        raise ConfigError(f"{where}: a hybrid model's decode side with prefix caching "
                          f"snapshots the linear-attention state the prefill side keeps "
                          f"only with it: enable_prefix_caching on both roles, or neither")
    if p.max_model_len > d.max_model_len:
        raise ConfigError(f"{where}: prefill accepts {p.max_model_len}-token contexts but "
                          f"decode only {d.max_model_len} (max_model_len)")


class _PDLayout:
    """What a result reports as the deployment's layout."""

    def __init__(self, prefill: str, num_prefill: int, decode: str, num_decode: int) -> None:
        self.text = f"{num_prefill}x[{prefill}]+{num_decode}x[{decode}]"


class _Steps:
    """Every group's steps in one table, with its role and group, ranks renumbered."""

    def __init__(self, pd_engine: PDEngine) -> None:
        self.pd = pd_engine

    def frame(self) -> pd.DataFrame:
        frames, rank0, inst0 = [], 0, 0
        for role, engines in (("prefill", self.pd.prefill), ("decode", self.pd.decode)):
            for g, e in enumerate(engines):
                f = e.step_recorder.frame()
                f.insert(0, "role", role)
                f.insert(1, "group", g)
                f["rank"] = f["rank"] + rank0
                f["instance"] = f["instance"] + inst0
                rank0 += e.layout.num_dp_ranks
                inst0 += len(e.instances)
                frames.append(f)
        return pd.concat(frames, ignore_index=True).sort_values(
            ["start_s", "rank"], kind="stable", ignore_index=True)

