"""The engine's KV offload: a `NodeStore` per node, fed and read by the control plane.

Wiring (see `kv/tiers.py` for the tiers themselves):

- the KV managers call `cached(rank, blocks, keys, now)` whenever their prefix cache
  registers full blocks — the write-through into the node's host tier;
- the schedulers ask `offer(req, cached)` (a prefix source, `transfer.py`) at a
  request's first admission: the blocks after its GPU prefix match that the node's
  tiers hold, with the time to load them — offered only when that beats the cost
  model's time to recompute them (`prefill_seconds`);
- on a data plane that computes, every block move goes to it as a step command
  (`TierMoves`, through the engine's `outbox`): the plane copies the tensors (host
  tier) and writes the files (disk tier). The plane reports each block file it wrote
  (`DiskWrite`: path and digest, or none when the disk refused it); before a load is
  offered, and again when it starts, the control plane checks the files against those
  digests itself (`kv/block_check.py`) and forgets a damaged block (recomputing from
  it on) — it decides without asking the plane. Moves that write files are delivered
  at once (`outbox.flush`), so a refused write is forgotten before the next decision,
  as when the moves were direct calls; the other moves ride on the next step.

Hybrid models narrow where a loaded prefix may end: at a block boundary with a
linear-state snapshot (`snapshots_of`), or where the tiers also hold the pages of the
sliding-window layers for the window behind it (`window_of`; window pages are written
through like blocks, under their own keys, and loaded with the prefix).

Each DP rank's PCIe links carry one load at a time: a load starts when the previous
one on that rank has landed.

**A store shared by instances that fast-forward.** Where several independent instances
share a node's store (dp8 on one node), step-by-step simulation writes their blocks
through in time order, step by step across the instances. Fast-forwarded runs play late
— a run's steps when it commits, or when someone syncs it — so their writes would reach
the store out of that order (and a tier's LRU order and evictions depend on it), and an
instance reading the store at a commit would miss writes other instances' runs have not
played yet. So where runs play late (`play_until` given), writes wait in the store's
`pending` list; before the store is read at time t (`catch_up`), the instances sharing
it are played up to t and the writes are applied in time order. Writes carry their
step's time; writes at the same time go rank by rank (the order of step-by-step's
commits, within a lockstep instance and across independent ones), then in the order they
were played — except that the writes of steps ending then come before those of steps
starting then (a prefix copied in that arrived: step by step, every instance commits
the steps ending at a time before any plans the next).

Sizes come in GiB per node (`cpu_kv_gib`, `disk_kv_gib`); a replica larger than a node
pools its nodes' tiers.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from labkit.engine.events import EventBus, KVLoadDeclined, KVLoaded, KVOffloaded
from labkit.engine.kv.block_check import TierCorruption, file_intact
from labkit.engine.kv.tiers import Move, NodeStore, Tier
from labkit.engine.step_io import DiskWrite, TierMoves
from labkit.engine.transfer import PrefixTransfer
from labkit.errors import ConfigError

GIB = 2**30


class Offload:
    def __init__(self, config, hardware, layout, placement, block_size: int, block_layout,
                 num_ranks: int, events: EventBus, prefill_seconds: Callable[[int, int], float],
                 block_table: Callable[[object], object], *,
                 snapshots_of: Callable[[int], object] | None = None,
                 window_of: Callable[[int], object] | None = None,
                 outbox=None, play_until: Callable[[range, float], None] | None = None) -> None:
        """`block_layout`: how a block sits in GPU memory (`kv/packing.py`);
        `prefill_seconds(new_tokens, context)`: the cost model's time to recompute;
        `block_table(request)`: its block ids on its rank; `play_until(ranks, t)`: plays
        the fast-forwarded runs of these ranks up to t — given where runs play late,
        writes then wait for the store to be read (see the module docstring). The
        rest, see below."""
        self.block_size = block_size
        self.block_table = block_table
        # hybrid models: rank -> its state snapshots (a loaded prefix must end at one),
        # rank -> its sliding-window tables (a loaded prefix brings its window along)
        self.snapshots_of = snapshots_of
        self.window_of = window_of
        # a plane that computes: where the moves go as commands (and its reports return)
        self.outbox = outbox
        self.strict = config.kv_offload_strict
        self._files: dict[tuple[int, int], tuple[str, bytes]] = {}  # disk: (path, digest)
        self._intact: set[tuple[int, int]] = set()  # checked already
        self.events = events
        self.prefill_seconds = prefill_seconds
        block_bytes = block_size * placement.kv_bytes_per_token()
        per_gpu = block_layout.block_bytes
        g = layout.gpus_per_replica
        nodes_per_store = max(1, math.ceil(g / hardware.gpus_per_node))
        self.ranks_per_store = max(1, hardware.gpus_per_node // g)
        tiers = _tier_sizes(config, hardware, block_bytes, nodes_per_store)
        self.stores = [
            NodeStore(i, [Tier(name, blocks, bw, lat, config.kv_offload_eviction)
                          for name, blocks, bw, lat in tiers], block_bytes, per_gpu,
                      block_layout.copy_overhead_s)
            for i in range(math.ceil(num_ranks / self.ranks_per_store))
        ]
        self._link_free_s = [0.0] * num_ranks
        self.num_ranks = num_ranks
        self.play_until = play_until
        # per store, writes not applied yet: (time, as a step starts, rank, order played,
        # blocks, keys) — sorted so, the order step-by-step simulation applies them in
        self.pending: list[list] | None = None if play_until is None else \
            [[] for _ in self.stores]
        self._declined: set[str] = set()
        self._located: dict[str, tuple] = {}  # request -> (store version, first, found)

    def store_of(self, rank: int) -> NodeStore:
        return self.stores[rank // self.ranks_per_store]

    # ---------------------------------------------------------------- write
    def cached(self, rank: int, blocks, keys, now: float, starting: bool = False) -> None:
        """Newly cached blocks of `rank`, written through at `now` (or held until the
        store is read, where runs play late); `starting`: as a step starts, not as one
        ends (`KVManager.cache_full_blocks`)."""
        if self.pending is None:
            self._write(self.store_of(rank), rank, blocks, keys, now)
            return
        pending = self.pending[rank // self.ranks_per_store]
        pending.append((now, starting, rank, len(pending), np.array(blocks), np.array(keys)))

    def _write(self, store: NodeStore, rank: int, blocks, keys, now: float) -> None:
        moves = store.store(keys, rank, blocks)
        if moves:
            self._moved(store, moves, now)

    def catch_up(self, store: NodeStore, now: float) -> None:
        """The store as step-by-step simulation has it at `now`: the runs of the ranks
        sharing it played up to now, their writes applied in time order."""
        if self.pending is None:
            return
        lo = store.index * self.ranks_per_store
        self.play_until(range(lo, min(lo + self.ranks_per_store, self.num_ranks)), now)
        pending = self.pending[store.index]
        if not pending:
            return
        pending.sort(key=lambda w: w[:4])
        for t, _, rank, _, blocks, keys in pending:
            self._write(store, rank, blocks, keys, t)
        pending.clear()

    def _moved(self, store: NodeStore, moves: list, now: float) -> None:
        self._apply(store, moves)
        if self.events.wants(KVOffloaded):
            count = {k: sum(m.kind == k for m in moves) for k in ("store", "demote", "drop")}
            self.events.emit(KVOffloaded(now, store.index, count["store"], count["demote"],
                                         count["drop"]))

    # ----------------------------------------------------------------- read
    def offer(self, req, cached: int, now: float) -> PrefixTransfer | None:
        """The run of blocks after req's `cached` tokens that the tiers hold, if loading
        them is quicker than recomputing them."""
        bs, keys = self.block_size, req.keys
        if keys is None or cached % bs:
            return None  # a partial (forked) tail: tier blocks are whole blocks
        first = cached // bs
        limit = min((req.num_tokens - 1) // bs, keys.num_blocks)  # recompute >= 1 token
        if first >= limit:
            return None
        store = self.store_of(req.rank)
        self.catch_up(store, now)
        found, load_s, recompute_s = self._costs(req, store, first, limit)
        readable = self._readable(store, keys.keys(first, first + len(found)).tolist(), found)
        if readable < len(found):  # recompute from the first unreadable block on
            found, load_s, recompute_s = self._costs(req, store, first, limit)
        n, extra = self._usable_end(req.rank, store, keys, first, len(found))
        if n < len(found) or extra[0]:
            found = found[:n]
            load_s = store.load_seconds(found + extra[1])
            recompute_s = self.prefill_seconds(n * bs, first * bs) if n else 0.0
        if not found:
            return None
        tokens = len(found) * bs
        if load_s >= recompute_s:
            if req.request_id not in self._declined and self.events.wants(KVLoadDeclined):
                self.events.emit(KVLoadDeclined(now, req.rank, req.request_id,
                                                tokens, load_s, recompute_s))
            self._declined.add(req.request_id)
            return None

        def admit(r, now: float) -> float:
            return self._load(r, store, first, found, load_s, now, extra)
        return PrefixTransfer(cached + tokens, load_s, admit)

    def _usable_end(self, rank: int, store: NodeStore, keys, first: int, n: int) -> tuple:
        """How many of the n blocks found from block `first` a load may bring, and the
        window pages it brings too ((keys, tiers)): a hybrid model's prefix must end
        at a linear-state snapshot, or where the tiers also hold its window."""
        snapshots = self.snapshots_of(rank) if self.snapshots_of is not None else None
        if n and snapshots is not None:
            return next((j for j in range(n, 0, -1)
                         if snapshots.has(keys.key(first + j - 1))), 0), ([], [])
        if n and self.window_of is not None:
            return self._window_end(store, self.window_of(rank), keys, first, n)
        return n, ([], [])

    def _window_end(self, store: NodeStore, window, keys, first: int, n: int) -> tuple:
        """Of a run of n blocks found from block `first`, the longest prefix whose end
        has its window in the tiers too: (its length, (the window pages' keys, their
        tiers)). The window is the pages of the last `hit_blocks` blocks before it."""
        for end in range(first + n, first, -1):
            page_keys = [int(k) for b in range(max(0, end - window.hit_blocks), end)
                         for k in window.page_keys(keys.key(b))]
            levels = [store.level(k) for k in page_keys]
            if None not in levels and self._readable(store, page_keys, levels) == len(levels):
                return end - first, (page_keys, levels)
        return 0, ([], [])

    def _readable(self, store: NodeStore, keys: list[int], levels: list[int]) -> int:
        """How many of the found blocks (`keys`, in tiers `levels`) can be read back: a
        disk block whose file fails its checksum is forgotten by the store (the load
        will stop before it)."""
        if self.outbox is None:
            return len(levels)
        for j, (key, level) in enumerate(zip(keys, levels)):
            if store.tiers[level].name != "disk":
                continue
            if (store.index, key) in self._intact:
                continue
            if not self.intact(store.index, key):
                self._drop_damaged(store, key)
                return j
            self._intact.add((store.index, key))
        return len(levels)

    def _costs(self, req, store: NodeStore, first: int, limit: int) -> tuple:
        """(tier of each block found, seconds to load them, seconds to recompute them).
        A request waiting for GPU blocks asks again at every step: the answer is kept
        until the store changes."""
        memo = self._located.get(req.request_id)
        if memo is not None and memo[:2] == (store.version, first):
            return memo[2]
        found = store.locate(req.keys.keys(first, limit).tolist())
        costs = (found, store.load_seconds(found),
                 self.prefill_seconds(len(found) * self.block_size, first * self.block_size)
                 if found else 0.0)
        if len(self._located) > 4096:  # requests long gone
            self._located.clear()
        self._located[req.request_id] = (store.version, first, costs)
        return costs

    def _load(self, req, store: NodeStore, first: int, found: list[int], load_s: float,
              now: float, window: tuple[list, list] = ([], [])) -> float | None:
        """Start the load (the request's blocks are allocated); None when one of its
        disk blocks no longer reads back intact: that block is forgotten and the
        scheduler asks again (loading less, or recomputing)."""
        rank, n = req.rank, len(found)
        keys = req.keys.keys(first, first + n).tolist()
        blocks = self.block_table(req)[first:first + n]
        levels = found
        if window[0]:  # into the window pages the request holds behind its prefix's end
            end, tables = first + n, self.window_of(rank)
            pages = tables.pages_of(req.request_id, max(0, end - tables.hit_blocks), end)
            keys, blocks = keys + window[0], np.concatenate([blocks, pages])
            levels = found + window[1]
        if self.outbox is not None:  # check again what the load reads: damage since the offer
            damaged = [k for k, level in zip(keys, levels)
                       if store.tiers[level].name == "disk" and not self._check(store.index, k)]
            if damaged:
                for key in damaged:
                    self._drop_damaged(store, key)
                return None
        self._located.pop(req.request_id, None)
        start = max(now, self._link_free_s[rank])  # one load at a time per rank's links
        self._link_free_s[rank] = start + load_s
        req.num_offload_tokens = n * self.block_size
        moves = store.take(keys, rank, blocks)
        self._apply(store, moves)
        if self.events.wants(KVLoaded):
            by_tier = {t.name: found.count(i) * self.block_size
                       for i, t in enumerate(store.tiers) if i in found}
            self.events.emit(KVLoaded(now, rank, req.request_id, n * self.block_size, by_tier,
                                      start + load_s - now, np.array(blocks),
                                      tuple(store.tiers[i].name for i in levels)))
        return start + load_s - now

    def _apply(self, store: NodeStore, moves: list) -> None:
        """Send the moves to the data plane; those that write block files at once, so
        that the files written, or refused, are known before the next decision."""
        if self.outbox is None:
            return
        self.outbox.send(TierMoves(store.index, moves))
        if any(m.kind == "demote" for m in moves):  # (a tier above the disk's)
            self.outbox.flush()
        self._settle()
        disk = store.tiers[-1].name
        for m in moves:  # a file deleted: its digest goes too
            if m.kind in ("drop", "discard") and m.tier == disk:
                self._files.pop((store.index, m.key), None)

    def _settle(self) -> None:
        """Take in the data plane's reports: where each block file is, with its digest;
        blocks the disk could not write are in no tier after all (the plane warned)."""
        for r in self.outbox.take_reports(DiskWrite):
            store = self.stores[r.store]
            if r.path is not None:
                self._files[(r.store, r.key)] = (r.path, r.digest)
                self._intact.discard((r.store, r.key))  # a new file: check it anew
            elif store.level(r.key) == len(store.tiers) - 1:
                store.forget(r.key, "unwritable_blocks")

    # ---------------------------------------------------------------- checks
    def intact(self, store: int, key: int) -> bool:
        """Are the bytes of disk block `key` (node store `store`) still what the data
        plane wrote? (Checked when a load is offered.)"""
        return self._check(store, key)

    def _check(self, store: int, key: int) -> bool:
        self._settle()
        where = self._files.get((store, key))
        if where is not None and file_intact(*where):
            return True
        if self.strict:
            raise TierCorruption(f"KV block {key:#x} on the disk tier "
                                 f"({where[0] if where else 'no file'}) is missing or "
                                 f"failed its checksum; kv_offload_strict is set")
        return False

    def _drop_damaged(self, store: NodeStore, key: int) -> None:
        """A disk block that failed its check: in no tier any more, its file removed."""
        store.forget(key)
        self._intact.discard((store.index, key))
        self._files.pop((store.index, key), None)
        self.outbox.send(TierMoves(store.index, [Move("discard", key, "disk")]))

    # --------------------------------------------------------------- report
    def summary(self, now: float = math.inf) -> dict:
        """The tiers' counters at `now` (the engine's time; by default, of every write
        so far)."""
        if self.outbox is not None:
            self._settle()
        for store in self.stores:
            self.catch_up(store, now)
        out = {}
        for name in [t.name for t in self.stores[0].tiers]:
            stats = [s.stats()[name] for s in self.stores]
            for field in ("stored_blocks", "hit_blocks", "evicted_blocks", "dropped_blocks",
                          "promoted_blocks", "corrupt_blocks", "unwritable_blocks"):
                out[f"{name}_tier_{field}"] = sum(getattr(x, field) for x in stats)
        return out


def _tier_sizes(config, hardware, block_bytes: float, nodes: int) -> list[tuple]:
    """(name, capacity in blocks, bandwidth, latency) of each configured tier."""
    tiers = []
    for name, gib, limit, bw, lat in (
            ("cpu", config.cpu_kv_gib, hardware.host_memory_bytes, hardware.pcie_bandwidth,
             hardware.host_link_latency_s),
            ("disk", config.disk_kv_gib, hardware.disk_bytes, hardware.disk_bandwidth,
             hardware.disk_latency_s)):
        if not gib:
            continue
        if gib * GIB > limit:
            raise ConfigError(f"{name}_kv_gib={gib} exceeds the {limit / GIB:,.0f} GiB a "
                              f"{hardware.name} node has for it")
        blocks = int(gib * GIB * nodes // block_bytes)
        if blocks < 1:
            raise ConfigError(f"{name}_kv_gib={gib} cannot hold one KV block "
                              f"({block_bytes / GIB:.3g} GiB per block)")
        tiers.append((name, blocks, bw, lat))
    return tiers


def check_offload_dir(config, backend: str) -> None:
    """kv_offload_dir names where block files go: only the compute plane's disk tier
    writes any, and one that is not configured writes none."""
    if config.kv_offload_dir is None:
        return
    if backend != "compute":
        raise ConfigError("kv_offload_dir only applies to backend='compute' (the simulated "
                          "disk tier keeps no bytes); drop it, or run the compute backend")
    if not config.disk_kv_gib:
        raise ConfigError("kv_offload_dir is where the disk tier writes its blocks: set "
                          "disk_kv_gib (and cpu_kv_gib) too, or drop it")
