"""Hybrid models' KV, wired into an engine: sliding-window tables and state snapshots.

A hybrid model keeps more than the full-attention KV every model has (see
`docs/hybrid_kv.md`):

- **sliding-window layers** get a second block table per request over the same pool,
  freed as the window moves (`kv/sliding_window.py`);
- **linear-attention layers** reuse a prefix only where a snapshot of their state was
  saved, in pool pages of the KV block size (`kv/state_snapshots.py`); on the compute
  plane the snapshots are real copies of the state tensors.

`attach_hybrid_kv` gives each DP rank's KV manager what its model needs;
`hybrid_summary` adds their counters to a run's summary.
"""

from __future__ import annotations

import math

from labkit.engine.kv.sliding_window import SlidingWindow
from labkit.engine.kv.state_snapshots import StateSnapshots
from labkit.engine.step_io import RestoreState, SaveState

SNAPSHOT_STATS = ("saved_at_call_end", "saved_on_second_sight", "skipped_no_space", "hits",
                  "tokens_recomputed")


def attach_hybrid_kv(engine) -> None:
    m, placement, bs = engine.model, engine.placement, engine.block_size
    for s in engine.schedulers:
        if m.sliding_window_layers:
            s.kv.window = SlidingWindow(s.kv.pool, bs, m.sliding_window,
                                        placement.window_pages_per_block(), engine.events,
                                        s.rank)
            if engine.offload is not None:  # window pages are written through too
                s.kv.window.on_cached = engine.offload.cached
                engine.offload.window_of = lambda rank: engine.schedulers[rank].kv.window
        if m.linear_layers and engine.config.enable_prefix_caching:
            pages = math.ceil(placement.state_bytes_per_gpu()
                              / (bs * placement.kv_bytes_per_token_per_gpu()))
            s.kv.snapshots = snaps = StateSnapshots(
                s.kv.pool, pages, engine.config.linear_state_retention)
            if engine.data_plane.computes:  # the states are real tensors: copy them
                commands = SnapshotCommands(engine.outbox, s.rank, snaps)
                snaps.on_saved, snaps.on_restored = commands.saved, commands.restored


class SnapshotCommands:
    """A rank's snapshot saves and restores, as commands for a data plane that holds the
    states (`step_io.SaveState` / `RestoreState`). A save also names the snapshots the
    plane was told of that the pool has evicted since, so the plane can drop them."""

    def __init__(self, outbox, rank: int, snapshots: StateSnapshots) -> None:
        self.outbox, self.rank, self.snapshots = outbox, rank, snapshots
        self.sent: set[int] = set()

    def saved(self, key: int, request_id: str, position: int) -> None:
        dropped = sorted(k for k in self.sent if not self.snapshots.has(k))
        self.sent.difference_update(dropped)
        self.sent.add(key)
        self.outbox.send(SaveState(self.rank, key, request_id, position, dropped))

    def restored(self, key: int, request_id: str, position: int) -> None:
        self.outbox.send(RestoreState(self.rank, key, request_id, position))


def hybrid_summary(schedulers) -> dict:
    out = {}
    kvs = [s.kv for s in schedulers]
    if kvs[0].window is not None:
        out["kv_window_blocks_freed"] = sum(kv.window.pages_slid for kv in kvs)
    snaps = [kv.snapshots.stats for kv in kvs if kv.snapshots is not None]
    if snaps:
        for name in SNAPSHOT_STATS:
            out[f"linear_state_{name}"] = sum(getattr(x, name) for x in snaps)
    return out
