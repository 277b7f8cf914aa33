"""How an engine is put together: the order its parts are made in, and who gets what.

Every part of the control plane is handed its collaborators when it is made; nothing
is attached to a part afterwards. That fixes the order (the engine has settled what is
served and where — model, layout, block geometry, the data plane — before it calls
`build_parts`):

1. **the outbox**: the commands for the data plane (block copies, state-snapshot saves
   and restores, releases, offload tier moves, P/D hand-overs), which ride on its next
   step (`step_message.py`), and the plane's reports on them;
2. **per DP rank, its block pool**, and in it what a hybrid model keeps besides its
   full-attention KV (`hybrid_kv.py`): the linear-state snapshots, which take pages of
   the same pool;
3. **the prefix sources** (`transfer.py`): those the caller brings (a P/D decode pool's
   hand-over), another DP rank's cache (`session_kv_migration="fetch"`) and the node's
   offload tiers (`cpu_kv_gib`, `offload.py`);
4. **per rank, the sliding-window tables** (their pages are written through to the
   offload tiers too), **the KV manager** (its pool, window tables, snapshots, and the
   tiers' write-through `on_cached`) **and the scheduler** (its KV manager, the prefix
   sources, and whether a finished request's KV is held to be sent on);
5. **the instances** (the ranks that step together) and **the router** in front.

One cycle cannot be ordered away: the prefix sources read the ranks' KV managers (a
moved session's blocks on its old rank, a request's table), while the schedulers that
own those KV managers ask the sources. `Ranks` breaks it in the open: it is made empty
before step 3, handed to the sources, and filled once at the end; a source reads it
only when a request is admitted, long after.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.engine.hybrid_kv import state_snapshots, window_tables
from labkit.engine.instance import Instance
from labkit.engine.kv.block_pool import BlockPool
from labkit.engine.kv.kv_manager import KVManager
from labkit.engine.offload import Offload
from labkit.engine.router import Router
from labkit.engine.scheduler import Scheduler
from labkit.engine.step_message import Outbox
from labkit.engine.transfer import RemoteFetch


@dataclass(slots=True)
class Parts:
    """What `build_parts` hands the engine."""

    outbox: Outbox
    schedulers: list[Scheduler]  # one per DP rank, each with its KV manager (`.kv`)
    instances: list[Instance]
    instance_of: dict[int, Instance]  # DP rank -> the instance that steps it
    router: Router
    offload: Offload | None  # the node's offload tiers (cpu_kv_gib), if any


class Ranks:
    """The engine's DP ranks as seen by the parts made before them (the prefix sources):
    the one late binding of an engine's construction. Filled once, by `build_parts`."""

    def __init__(self) -> None:
        self._schedulers: list[Scheduler] | None = None
        self._instance_of: dict[int, Instance] = {}

    def fill(self, schedulers: list[Scheduler], instance_of: dict[int, Instance]) -> None:
        if self._schedulers is not None:
            raise RuntimeError("Ranks is filled once, when the engine is built")
        self._schedulers, self._instance_of = schedulers, instance_of

    def kv(self, rank: int) -> KVManager:
        return self._schedulers[rank].kv

    def table(self, req):
        """req's block ids on its rank."""
        return self.kv(req.rank).table(req.request_id)

    def snapshots(self, rank: int):
        return self.kv(rank).snapshots

    def window(self, rank: int):
        return self.kv(rank).window

    def play_until(self, ranks, now: float) -> None:
        """The fast-forwarded runs of these ranks' instances played up to `now` (their
        KV work and steps: `Instance.sync`)."""
        for instance in dict.fromkeys(map(self._instance_of.get, ranks)):
            instance.sync(now, cut=False)

    def lookup(self, rank: int, req, now: float):
        """req's prefix as `rank` caches it at `now`, for a fetch: its fast-forwarded run
        played up to now where that matters (`Instance.lookup_at`)."""
        return self._instance_of[rank].lookup_at(self._schedulers[rank], req, now)


def build_parts(engine, prefix_sources=(), hold_kv_on_finish: bool = False) -> Parts:
    """The engine's control-plane parts, over its `data_plane`. `engine` is read for
    its settled description only (model, config, layout, placement, block geometry,
    events, cost model). `prefix_sources`: makers `make(engine) -> offer(req, cached,
    now)` of sources asked before the engine's own; `hold_kv_on_finish`: see
    `Scheduler`."""
    config, events, n = engine.config, engine.events, engine.layout.num_dp_ranks
    outbox = Outbox(engine.data_plane)  # 1
    ranks = Ranks()
    pools = [BlockPool(engine.num_blocks, config.enable_prefix_caching, events, r)
             for r in range(n)]  # 2
    snapshots = [state_snapshots(engine, pool, r, outbox) for r, pool in enumerate(pools)]
    offload = _offload(engine, ranks, outbox)  # 3
    sources = (*(make(engine) for make in prefix_sources),
               *_remote_fetch(engine, ranks, outbox),
               *([offload.offer] if offload is not None else []))
    on_cached = offload.cached if offload is not None else None  # 4
    schedulers = []
    for r, pool in enumerate(pools):
        kv = KVManager(engine.num_blocks, engine.block_size, config.enable_prefix_caching,
                       events, r, pool=pool, window=window_tables(engine, pool, r, on_cached),
                       snapshots=snapshots[r], on_cached=on_cached)
        schedulers.append(Scheduler(config, kv, events, r, sources, hold_kv_on_finish))
    groups = ([list(range(n))] if engine.layout.lockstep else [[r] for r in range(n)])  # 5
    block_bytes = engine.block_size * engine.placement.kv_bytes_per_token_per_gpu()
    instances = [Instance(i, members, [schedulers[r] for r in members], engine.data_plane,
                          config, events, outbox, block_bytes)
                 for i, members in enumerate(groups)]
    instance_of = {r: inst for inst in instances for r in inst.ranks}
    ranks.fill(schedulers, instance_of)
    return Parts(outbox, schedulers, instances, instance_of,
                 Router(config.router, schedulers, events), offload)


def _remote_fetch(engine, ranks: Ranks, outbox: Outbox) -> list[RemoteFetch]:
    """Another DP rank's cache (session_kv_migration="fetch"). The compute plane copies
    the blocks (a sliding-window model's window pages, a linear-attention model's
    state)."""
    compute = engine.data_plane.computes
    if engine.config.session_kv_migration != "fetch":
        return []
    return [RemoteFetch(ranks, engine.placement, engine.hardware, engine.layout,
                        engine.events, outbox if compute else None)]


def _offload(engine, ranks: Ranks, outbox: Outbox) -> Offload | None:
    """The node's offload tiers (cpu_kv_gib, disk_kv_gib)."""
    if not engine.config.cpu_kv_gib:
        return None
    m = engine.model
    # -- a plane that computes gets the tier moves as step commands (`TierMoves`) and
    #    reports the block files it wrote; the digests stay here (`kv/block_check.py`) --
    outbox = outbox if engine.data_plane.computes else None
    runs = engine.config.sim_fast_forward and engine.data_plane.supports_runs
    return Offload(engine.config, engine.hardware, engine.layout, engine.placement,
                   engine.block_size, engine.block_layout, engine.layout.num_dp_ranks,
                   engine.events, engine.prefill_seconds, ranks.table,
                   snapshots_of=ranks.snapshots if m.linear_layers else None,
                   window_of=ranks.window if m.sliding_window_layers else None, outbox=outbox,
                   play_until=ranks.play_until if runs else None)
