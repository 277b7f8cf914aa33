"""The engine: a deployment of one model, driven by a virtual clock.

`Engine` wires the control plane together — one scheduler and KV manager per DP rank,
a router in front, ranks grouped into instances that step (DEP ranks in lockstep) —
over a data plane that says how long each step takes. Time is virtual: it jumps from
event to event.

Two kinds of events drive it, kept in two heaps:

- **arrivals** (a request reaches the router at time t), fed by `submit` — usually by
  a replay driver that turns a trace into arrivals;
- **instance events**: *plan* (an instance picks its next step or run at time t) and
  *commit* (that step ends: tokens are emitted, requests finish).

At equal times arrivals go first, then commits, then plans, so a step always sees
every request that arrived by its start — including those that a just-finished call
released with zero delay.

    engine = Engine(model="llama-3.1-8b", layout="dp2", hardware="h200")
    engine.submit(request, at=0.0)
    while engine.step(): ...          # or engine.replay(trace, concurrency=8, ...)
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable

from labkit.engine.arrivals import Arrivals
from labkit.engine.build import build_parts
from labkit.engine.capacity import kv_capacity
from labkit.engine.events import EventBus, RequestArrived, RequestFinished
from labkit.engine.hybrid_kv import hybrid_summary
from labkit.engine.instance import Instance
from labkit.engine.kv.packing import block_layout
from labkit.engine.kv.sliding_window import check_sliding_window
from labkit.engine.metrics import StepRecorder
from labkit.engine.offload import check_offload_dir
from labkit.engine.request import Request
from labkit.engine.scheduler import RankBatch
from labkit.engine.sim.data_plane import SimDataPlane
from labkit.engine.sim.hisparse import HiSparse, HiSparseDataPlane, check_hisparse, \
    hisparse_blocks
from labkit.engine.sim.roofline import RooflineCostModel
from labkit.engine.step_work import StepWork
from labkit.errors import ConfigError, OversizeError, unknown_choice
from labkit.memory import collect_if_grown
from labkit.specs import EngineConfig, Layout, get_hardware, get_model
from labkit.tokenizer import load_tokenizer
from labkit.specs.dtypes import dtype_bytes

BACKENDS = ("sim", "compute")
COST_MODELS = ("calibrated", "roofline")
COMPUTE_KV_BUDGET_BYTES = 256 * 2**20  # per GPU, compute plane, unless overridden
_ARRIVAL, _COMMIT, _PLAN = 0, 1, 2
EVENT_KINDS = ("arrival", "commit", "plan")


def check_model_len(request_id: str, input_tokens: int, output_tokens: int, limit: int,
                    model_name: str, advice: str) -> None:
    """Raise ConfigError if a call is longer than max_model_len (`limit`): the message
    names it, then gives `advice` (what the caller can do about it)."""
    if input_tokens + output_tokens > limit:
        raise ConfigError(f"request {request_id}: {input_tokens} + {output_tokens} tokens "
                          f"exceed max_model_len={limit} of {model_name}{advice}")


class Engine(Arrivals):
    def __init__(self, model="llama-3.1-8b", layout="tp1", hardware="h200",
                 backend: str = "sim", cost_model=None, *, device: str | None = None,
                 dtype: str | None = None, clock: str | None = None, checkpoint=None,
                 executor: str | None = None, prefix_sources=(),
                 hold_kv_on_finish: bool = False, **knobs) -> None:
        """`backend="sim"` costs steps with `cost_model`; `backend="compute"` runs them
        on real tensors (`device` cpu|cuda, `dtype`, `clock` measured|predicted, an
        optional safetensors `checkpoint`, `executor` threads|mp: ranks as threads or
        as processes; see `labkit.engine.compute`).

        For engines that play a part in a larger deployment (P/D, `disagg.py`):
        `prefix_sources`, makers `make(engine) -> offer(req, cached, now)` of prefix
        sources its schedulers ask before their own (`transfer.py`), and
        `hold_kv_on_finish`, keep a finished request's KV until `release`."""
        if backend not in BACKENDS:
            raise unknown_choice("backend", backend, BACKENDS)
        collect_if_grown()  # earlier engines' cycles, once this process has grown (memory.py)
        super().__init__()  # the arrivals heap (`arrivals.py`)
        compute_opts = {k: v for k, v in dict(device=device, dtype=dtype, clock=clock,
                                               checkpoint=checkpoint, executor=executor).items()
                        if v is not None}
        if backend == "sim" and compute_opts:
            raise ConfigError(f"{', '.join(compute_opts)} only apply to backend='compute'")
        # what is served, on what, with which knobs; how much KV a rank holds
        self.model = get_model(model)
        self.tokenizer = load_tokenizer(self.model)  # text prompts (an HF folder's)
        self.hardware = get_hardware(hardware)
        self.config = knobs.pop("config", None) or EngineConfig.from_knobs(**knobs)
        check_offload_dir(self.config, backend)
        self.layout = Layout.parse(layout).with_dcp_knob(self.config.decode_context_parallel_size)
        self.layout.check_model(self.model)
        check_sliding_window(self.model, self.layout, self.config)
        self.backend = backend
        self.block_size = self.config.block_size or self.model.block_size
        self.max_model_len = self.config.max_model_len or self.model.max_model_len
        self.capacity = kv_capacity(self.model, self.hardware, self.layout, self.config,
                                    self.block_size, self.max_model_len)
        self.placement = self.capacity.placement
        self.block_layout = block_layout(self.placement, self.block_size, self.config.kv_layout)
        check_hisparse(self.model, self.config, backend)
        if self.config.hisparse_buffer_tokens and self.config.num_gpu_blocks_override is None:
            self.capacity = dataclasses.replace(self.capacity, num_blocks=hisparse_blocks(
                self.placement, self.hardware, self.config, self.block_size,
                self.capacity.available_bytes_per_gpu))  # the host pool, GPU-bounded
        self.num_blocks = self.capacity.num_blocks
        self.events = EventBus()
        self.step_recorder = StepRecorder(self.events)

        # where steps run: the data plane (costed by the cost model, or real tensors)
        self.cost_model = self._cost_model(cost_model)
        self.hisparse = None if not self.config.hisparse_buffer_tokens else HiSparse(
            self.placement, self.hardware, self.block_layout, self.block_size,
            self.config.hisparse_buffer_tokens, self.config.seed)
        self.data_plane = self._data_plane(compute_opts)
        # the ranks, their KV managers and schedulers, the prefix sources, the instances
        # and the router: made in order, each given what it uses (`build.py`)
        parts = build_parts(self, prefix_sources, hold_kv_on_finish)
        self.outbox = parts.outbox  # commands for the data plane, sent with a step
        self.schedulers, self.instances = parts.schedulers, parts.instances
        self._instance_of, self.router, self.offload = parts.instance_of, parts.router, \
            parts.offload
        if self.data_plane.computes or self.hisparse is not None:  # per-request state
            self.events.subscribe(self._release_on_finish, RequestFinished)
        # the virtual clock and its events
        self.now = 0.0
        self.stop_s = math.inf
        self._timers: list = []
        # (timers count on their own: `Request.seq`, the arrivals' count, must not depend
        # on how many steps were timed, fewer where runs fast-forward: P/D orders
        # hand-overs landing together by it, across decode groups)
        self._timer_seq = 0
        self._waking: dict[int, float] = {}  # instance -> time of its pending plan event
        self._held_up: set[int] = set()  # instances waiting for KV held for others to free
        self.requests: dict[str, Request] = {}
        self.finish_callbacks: list[Callable[[Request, float], None]] = []

    # -------------------------------------------------------------- set-up
    def _release_on_finish(self, event) -> None:
        """A finished request's per-request state in the data plane (the compute plane's
        tensors, HiSparse's buffers) goes, unless its KV is held to be sent on, as a P/D
        prefill's is: `disagg.py` releases it then."""
        req = event.request
        if not self.schedulers[req.rank].hold_kv_on_finish:
            self.outbox.release(req.request_id)

    def kv_released(self, rank: int, now: float) -> None:
        """KV held for others (a P/D prefill's, until its hand-over lands) was freed on
        `rank` at `now`: its instance, if its waiting requests found no room, plans again
        then (vLLM's prefill side waits for the decode side's reads as well)."""
        instance = self._instance_of[rank]
        if instance.index in self._held_up:  # (idle since: no plan, no plan event)
            self._held_up.discard(instance.index)
            self._waking[instance.index] = now
            self._push_timer(now, _PLAN, instance)

    def release(self, request_id: str) -> None:
        """The data plane may drop a request's per-request state (with the next step)."""
        self.outbox.release(request_id)

    def flush_commands(self) -> None:
        """Deliver the commands queued for the data plane now (before reading or moving
        its bytes from outside a step, e.g. a P/D hand-over)."""
        self.outbox.flush()

    def request_kv(self, req: Request, layer: int, gpu: int):
        """Compute plane: what GPU `gpu` holds of request `req`'s KV in `layer` — the
        positions it owns (all of them, or its DCP shard) and, per cache tensor, their
        entries. A finished request's KV is what is still cached of it (whole blocks); a
        sliding-window layer holds only the positions its window table still has pages
        for (none once the request finished)."""
        self.outbox.flush()
        kv = self.schedulers[req.rank].kv
        table, n = kv.held_blocks(req)
        window = kv.window_table(req.request_id) if kv.window is not None else None
        return self.data_plane.request_kv(req.rank, table, n, layer, gpu, window)

    def _cost_model(self, choice):
        """The step model: "calibrated" (default: layer by layer from kernels fitted on
        measured H100 latencies), "roofline" (a first-order sketch), or an object with
        `step_timing(work, lockstep)` and `min_step_s`."""
        if choice is None or choice == "calibrated":
            from labkit.costmodel import CostModel
            from labkit.engine.sim.layer_model import LayerStepModel

            return LayerStepModel.from_config(self.placement, CostModel(self.hardware),
                                              self.config)
        if choice == "roofline":
            return RooflineCostModel(self.model, self.hardware, self.layout,
                                     self.config.kv_dtype())
        if isinstance(choice, str):
            raise unknown_choice("cost model", choice, COST_MODELS)
        return choice

    def extra_summary(self) -> dict:
        """Summary entries of the optional mechanisms: offload tiers, HiSparse, hybrid
        models' window and state snapshots."""
        out = self.offload.summary(self.now) if self.offload is not None else {}
        allocated = sum(s.kv.slots_allocated for s in self.schedulers)
        used = sum(s.kv.slots_used for s in self.schedulers)
        out["kv_internal_fragmentation"] = 1.0 - used / allocated if allocated else 0.0
        if self.hisparse is not None:
            out.update(self.hisparse.summary())
        out.update(hybrid_summary(self.schedulers))
        return out

    def _data_plane(self, compute_opts: dict):
        """Where steps run: the simulated cluster (with HiSparse's copies added, if on)
        or real tensors."""
        if self.backend == "compute":
            return self._compute_plane(compute_opts)
        plane = SimDataPlane(self.cost_model)
        return plane if self.hisparse is None else HiSparseDataPlane(plane, self.hisparse)

    def _compute_plane(self, opts: dict):
        """The compute data plane, with its KV blocks capped to what fits in
        `COMPUTE_KV_BUDGET_BYTES` per GPU (unless num_gpu_blocks_override says)."""
        from labkit.engine.compute.data_plane import ComputeDataPlane, check_dtype, \
            check_kv_memory

        dtype = check_dtype(opts.get("dtype", "float32"))
        per_token = self.placement.kv_bytes_per_token_per_gpu() / \
            dtype_bytes(self.config.kv_dtype()) * dtype.itemsize
        if self.config.num_gpu_blocks_override is None:
            fit = int(COMPUTE_KV_BUDGET_BYTES // max(per_token * self.block_size, 1))
            self.num_blocks = max(1, min(self.num_blocks, fit))
        check_kv_memory(opts.get("device", "cpu"), self.num_blocks * self.block_size * per_token,
                        self.layout.gpus)
        clock = opts.get("clock", "measured")
        return ComputeDataPlane(
            self.model, self.layout, self.config, self.num_blocks, self.block_size,
            device=opts.get("device", "cpu"), dtype=dtype, clock=clock,
            cost_model=self.cost_model, checkpoint=opts.get("checkpoint"),
            executor=opts.get("executor", "threads"))

    @property
    def gpus(self) -> int:
        return self.layout.gpus

    @property
    def computes(self) -> bool:
        """Does the data plane run real tensors (calls need token ids, produce tokens)?"""
        return self.data_plane.computes

    @property
    def running_slots(self) -> int:
        """Requests that can run at once: max_num_seqs on every DP rank."""
        return self.config.max_num_seqs * self.layout.num_dp_ranks

    @property
    def num_blocks_per_rank(self) -> int:
        return self.num_blocks

    def check_fits(self, request_id: str, input_tokens: int, output_tokens: int) -> None:
        """Raise ConfigError if a request could never run on one DP rank."""
        total = input_tokens + output_tokens
        check_model_len(request_id, input_tokens, output_tokens, self.max_model_len,
                        self.model.name, "; raise max_model_len or skip such calls "
                                         "(on_oversize='skip')")
        cfg = self.config
        if not cfg.enable_chunked_prefill and \
                min(input_tokens, cfg.long_prefill_token_threshold or input_tokens) \
                > cfg.max_num_batched_tokens:
            raise ConfigError(
                f"request {request_id}: a {input_tokens}-token prompt cannot be prefilled "
                f"in one step of max_num_batched_tokens={cfg.max_num_batched_tokens} "
                f"with enable_chunked_prefill off (nor in chunks of "
                f"long_prefill_token_threshold: {cfg.long_prefill_token_threshold or 'unset'})"
            )
        blocks = -(-(total + self.config.num_speculative_tokens) // self.block_size)
        if self.model.sliding_window_layers:  # at worst a window plus a whole chunk
            span = self.model.sliding_window + min(total, self.config.max_num_batched_tokens)
            blocks += self.placement.window_pages_per_block() * min(
                blocks, -(-span // self.block_size) + 1)
        if blocks > self.num_blocks_per_rank:
            raise OversizeError(
                f"request {request_id} needs {blocks} KV blocks ({total} tokens) but a DP "
                f"rank holds {self.num_blocks_per_rank} blocks of {self.block_size} tokens; "
                f"raise num_gpu_blocks_override / gpu_memory_utilization or use more GPUs"
            )

    def prefill_seconds(self, new_tokens: int, context: int) -> float:
        """The cost model's time for one rank to prefill `new_tokens` after `context`
        cached ones (what recomputing a prefix would cost)."""
        batch = RankBatch(0, [None], [new_tokens], [context], [False])
        return float(self.cost_model.step_timing(StepWork.from_batches([batch]),
                                                 False).duration[0])

    # -------------------------------------------------------------- running
    def step(self) -> bool:
        """Process events up to and including the next committed step (or run).

        Returns False when nothing is left to do before `stop_s`.
        """
        while True:
            kind = self._process_next()
            if kind is None:
                return False
            if kind == _COMMIT:
                return True

    def has_events(self, before: float | None = None) -> bool:
        """Is anything left to happen before `before` (default: `stop_s`)?"""
        return self.next_event_time() < (self.stop_s if before is None else before)

    def process_event(self) -> str | None:
        """Process the next event before `stop_s`; returns its kind ("arrival",
        "commit": a step ended, "plan"), or None when none is left."""
        kind = self._process_next()
        return None if kind is None else EVENT_KINDS[kind]

    def run_until(self, t: float = math.inf) -> None:
        """Process every event before time t (everything, by default)."""
        self.stop_s = t
        while self._process_next() is not None:
            pass

    def next_event_time(self) -> float:
        """When the next live event happens (inf when none is left)."""
        self._drop_stale_timers()
        a = self._arrivals[0][0] if self._arrivals else math.inf
        b = self._timers[0][0] if self._timers else math.inf
        return min(a, b)

    def _drop_stale_timers(self) -> None:
        while self._timers and self._timers[0][1] == _COMMIT and \
                self._timers[0][5] != self._timers[0][4].plan_version:
            heapq.heappop(self._timers)  # that plan was cut short and rescheduled

    def _process_next(self):
        kind = self._process_event()
        if kind is None:  # nothing more to run now: the data plane catches up
            self.outbox.flush()
        return kind

    def _process_event(self):
        self._drop_stale_timers()
        arrival = self._arrivals[0] if self._arrivals else None
        timer = self._timers[0] if self._timers else None
        if arrival is None and timer is None:
            return None
        if timer is None or (arrival is not None and (arrival[0], _ARRIVAL) <= timer[:2]):
            t = arrival[0]
            if t >= self.stop_s:
                return None
            heapq.heappop(self._arrivals)
            self.now = t
            self._arrive(arrival[2])
            return _ARRIVAL
        t, kind, _, _, instance, _ = timer
        if t >= self.stop_s:
            return None
        heapq.heappop(self._timers)
        self.now = t
        if kind == _COMMIT:
            self._commit(instance)
        else:
            self._plan(instance)
        return kind

    def _push_timer(self, t: float, kind: int, instance: Instance) -> None:
        """Instances' events at the same time go in instance order: not in the order
        they were scheduled, which differs between a run fast-forwarded and stepped (two
        ranks ending the same work at the same float time, a call arriving as one of them
        finishes, saw the other's call still running in one and finished in the other)."""
        self._timer_seq += 1
        heapq.heappush(self._timers, (t, kind, instance.index, self._timer_seq, instance,
                                      instance.plan_version))

    def _arrive(self, req: Request) -> None:
        if self.events.wants(RequestArrived):
            self.events.emit(RequestArrived(self.now, req.request_id, req.session_id))
        if self.router.reads_progress:
            for instance in self.instances:  # let fast-forwarded runs catch up to now...
                instance.sync(self.now, cut=False)
        # (otherwise the router reads only what a run leaves unchanged until it ends —
        # queue lengths, sessions' homes — a rank's KV is played up to a time when
        # another rank fetches from it, and a node's offload store when it is read
        # (`offload.py`): the other runs play on when they commit)
        rank = self.router.route(req, self.now)
        target = self._instance_of[rank]
        # ...and cut the one the newcomer joins; the others' runs go on (a step-by-step
        # replay takes the same steps). Its scheduler judges it visible from now (a P/D
        # hand-over too: it reaches its decode group now, its call arrived earlier)
        req.enqueued_s = self.now
        if target.sync(self.now):
            target.plan_version += 1
            self._push_timer(target.plan.end, _COMMIT, target)
        self.schedulers[rank].add_request(req)
        self._wake(self._instance_of[rank])

    def _wake(self, instance: Instance) -> None:
        if instance.plan is None and instance.index not in self._waking:
            self._waking[instance.index] = self.now
            self._push_timer(self.now, _PLAN, instance)

    def _plan(self, instance: Instance) -> None:
        self._waking.pop(instance.index, None)
        self._held_up.discard(instance.index)
        if instance.plan is not None:
            return
        # A run may go past the next arrival: the arrival cuts it only if it joins this
        # instance (`_arrive`), and which instance that is is not known yet.
        plan = instance.plan_next(self.now, self.stop_s)
        if plan is not None:
            instance.plan = plan
            instance.plan_version += 1
            self._push_timer(plan.end, _COMMIT, instance)
        elif instance.has_work():
            ready = instance.next_ready_s()
            if ready is None and instance.holds_kv_for_others():
                self._held_up.add(instance.index)  # `kv_released` wakes it
                return
            if ready is None:
                raise RuntimeError(f"instance {instance.index}: requests wait but none can be "
                                   f"scheduled (KV cache too small for them?)")
            self._waking[instance.index] = ready
            self._push_timer(ready, _PLAN, instance)

    def _commit(self, instance: Instance) -> None:
        plan = instance.plan
        for req in instance.commit(plan):
            if self.events.wants(RequestFinished):
                self.events.emit(RequestFinished(self.now, req))
            for callback in self.finish_callbacks:
                callback(req, self.now)
        if instance.plan is not None:  # a run the finished requests left goes on
            self._push_timer(instance.plan.end, _COMMIT, instance)
        else:
            self._wake(instance)

    # --------------------------------------------------------- lifetime
    def close(self) -> None:
        """Let the compute plane's ranks (weights, paged KV caches), worker processes and
        tier files go now, not when the cycle collector finds this engine (`memory.py`);
        results stay readable, a closed compute engine refuses to step (a simulated one
        holds nothing). `with Engine(...) as engine:` closes on the way out."""
        self.data_plane.close()

    # ------------------------------------------------------------ replay
    def replay(self, trace, concurrency: int | None = None, duration_s: float | None = None,
               open_loop: bool = False, **options):
        """Replay a trace; returns a ReplayResult (requests, steps, summary).

        Closed loop (AgentX): `concurrency` sessions in flight for `duration_s`.
        Open loop: requests arrive at their trace timestamps (`open_loop=True`).
        Options: warmup_s (excluded from the summary), max_idle_s (cap on tool
        gaps), start_part_way (first sessions start at a random turn; off by
        default: each would prefill its whole context cold, see `replay.py`), loop_trace
        (start over with fresh ids when sessions run out), progress (a tqdm bar),
        on_oversize ("error" or "skip" requests that can never run, see oversize.py),
        and the summary's service-level metrics (slo.py): slo ({"ttft": 2.0, ...} or
        "ttft=2,tpot=0.05"), percentiles ((50, 90, 99)), gpu_hour_usd.
        """
        from labkit.engine.replay import replay

        return replay(self, trace, concurrency=concurrency, duration_s=duration_s,
                      open_loop=open_loop, **options)

    def result(self, warmup_s: float = 0.0, **metrics):
        """Requests, steps and summary of everything the engine has done so far — for
        runs driven by hand with `submit` and `step` / `run_until`. `metrics`: slo,
        percentiles, gpu_hour_usd (see `Engine.replay`)."""
        from labkit.engine.metrics import collect_result
        from labkit.engine.slo import metric_options

        return collect_result(self, warmup_s=warmup_s, end_s=max(self.now, warmup_s),
                              wall_s=0.0, options=metric_options(**metrics))

    def start_replay(self, trace, concurrency: int | None = None,
                     duration_s: float | None = None, open_loop: bool = False, **options):
        """Set a replay up without running it: then `engine.step()` step by step (what
        the notebook dashboard does), `run.finish()`, and `run.result()` any time."""
        from labkit.engine.replay import start_replay

        return start_replay(self, trace, concurrency=concurrency, duration_s=duration_s,
                            open_loop=open_loop, **options)

