"""Hybrid models' KV, wired into an engine: sliding-window tables and state snapshots.

A hybrid model keeps more than the full-attention KV every model has (see
`docs/hybrid_kv.md`):

- **sliding-window layers** get a second block table per request over the same pool,
  freed as the window moves (`kv/sliding_window.py`);
- **linear-attention layers** reuse a prefix only where a snapshot of their state was
  saved, in pool pages of the KV block size (`kv/state_snapshots.py`); on the compute
  plane the snapshots are real copies of the state tensors.

`window_tables` and `state_snapshots` make what a DP rank's KV manager needs for its
model (the engine's builder, `build.py`, passes them to it); `hybrid_summary` adds
their counters to a run's summary.
"""

from __future__ import annotations

import math

from labkit.engine.kv.sliding_window import SlidingWindow
from labkit.engine.kv.state_snapshots import StateSnapshots, snapshot_held
from labkit.engine.step_io import RestoreState, SaveState

SNAPSHOT_STATS = ("saved_at_call_end", "saved_on_second_sight", "skipped_no_space", "hits",
                  "tokens_recomputed")


def window_tables(engine, pool, rank: int, on_cached=None) -> SlidingWindow | None:
    """A rank's sliding-window tables, over its pool (None for a model without such
    layers); `on_cached`: the offload tiers' write-through, window pages too."""
    m = engine.model
    if not m.sliding_window_layers:
        return None
    return SlidingWindow(pool, engine.block_size, m.sliding_window,
                         engine.placement.window_pages_per_block(), engine.events, rank,
                         on_cached)


def state_snapshots(engine, pool, rank: int, outbox) -> StateSnapshots | None:
    """A rank's linear-state snapshots, in its pool (None without linear layers or
    without prefix caching). On a plane that computes, the states are real tensors:
    each save and restore becomes a command for it (`SnapshotCommands`)."""
    m, placement, bs = engine.model, engine.placement, engine.block_size
    if not (m.linear_layers and engine.config.enable_prefix_caching):
        return None
    pages = max(1, math.ceil(placement.state_bytes_per_gpu()
                             / (bs * placement.kv_bytes_per_token_per_gpu())))
    hooks = {}
    if engine.data_plane.computes:
        commands = SnapshotCommands(outbox, rank, pool, pages)
        hooks = dict(on_saved=commands.saved, on_restored=commands.restored)
    return StateSnapshots(pool, pages, engine.config.linear_state_retention, **hooks)


class SnapshotCommands:
    """A rank's snapshot saves and restores, as commands for a data plane that holds the
    states (`step_io.SaveState` / `RestoreState`). A save also names the snapshots the
    plane was told of that the pool has evicted since, so the plane can drop them."""

    def __init__(self, outbox, rank: int, pool, pages_per_snapshot: int) -> None:
        self.outbox, self.rank = outbox, rank
        self.pool, self.pages = pool, pages_per_snapshot  # where the snapshots live
        self.sent: set[int] = set()

    def saved(self, key: int, request_id: str, position: int) -> None:
        dropped = sorted(k for k in self.sent if not snapshot_held(self.pool, k, self.pages))
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
