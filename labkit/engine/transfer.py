"""Prefix KV that arrives from elsewhere instead of being recomputed.

When a call is admitted, its rank's prefix cache may hold only part of its prompt while
the rest sits somewhere it can be copied from: another DP rank's GPUs (a session that
moved, `session_kv_migration="fetch"`) or the node's offload tiers (host memory,
disk). Each such place is a *prefix source*: given the request, the tokens already
cached here and the time, it offers a `PrefixTransfer` — how many prefix tokens the request would
then hold, and an `admit` that does the bookkeeping once the scheduler has reserved
the blocks (counters, events, the bytes themselves in the compute plane) and returns
how long the copy takes. The scheduler takes the offer that brings the most tokens
(the quicker one on a tie); the request then waits, its blocks held, until the KV
has arrived, while other requests keep the GPU busy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from labkit.engine.events import KVFetched
from labkit.engine.step_io import FetchState


@dataclass(slots=True)
class PrefixTransfer:
    tokens: int  # prefix tokens held once the copy lands (those cached here included)
    seconds: float  # the copy's duration, as estimated when offered
    # (request, now) -> seconds until it lands; None when the copy cannot be made after
    # all (the scheduler then releases the blocks and asks the sources again)
    admit: Callable[[object, float], float | None]


def best_transfer(offers) -> PrefixTransfer | None:
    offers = [o for o in offers if o is not None]
    return max(offers, key=lambda o: (o.tokens, -o.seconds), default=None)


class RemoteFetch:
    """Prefix source: the rank that served a moved session's previous call still caches
    its prefix; each GPU copies its own shard over NVLink (same node) or its NIC."""

    LATENCY_S = 50e-6  # set-up of a KV transfer between ranks
    LINK_EFFICIENCY = 0.8

    def __init__(self, ranks, placement, hardware, layout, events, outbox=None) -> None:
        """`ranks`: the engine's DP ranks (`build.Ranks`: their KV managers, and
        `lookup(rank, req, now)`, a rank's cache as step-by-step simulation has it at now:
        its fast-forwarded run played up to now where that could change the answer).
        `outbox`: where a plane that computes gets the copies as commands (the blocks,
        and a hybrid model's state at the prefix's end: its snapshot on the source)."""
        self.ranks, self.hardware = ranks, hardware
        self.kv_bytes_per_token = placement.kv_bytes_per_token_per_gpu()  # (frozen)
        self.replicas_per_node = max(1, hardware.gpus_per_node // layout.gpus_per_replica)
        self.events = events
        self.outbox = outbox

    def __call__(self, req, cached: int, now: float) -> PrefixTransfer | None:
        hint = req.prefix_hint
        if hint is None or hint.rank == req.rank:
            return None
        match = self.ranks.lookup(hint.rank, req, now)
        if match.num_tokens <= cached:
            return None
        nbytes = match.num_tokens * self.kv_bytes_per_token
        same_node = hint.rank // self.replicas_per_node == req.rank // self.replicas_per_node
        link = self.hardware.nvlink_bandwidth if same_node else \
            self.hardware.internode_bandwidth
        seconds = self.LATENCY_S + nbytes / (link * self.LINK_EFFICIENCY)

        def admit(r, now: float) -> float:
            r.num_fetched_tokens = match.num_tokens - cached
            if self.outbox is not None:
                self._copy(hint.rank, r, match)
            if self.events.wants(KVFetched):
                self.events.emit(KVFetched(now, r.rank, r.request_id, hint.rank,
                                           r.num_fetched_tokens, seconds))
            return seconds
        return PrefixTransfer(match.num_tokens, seconds, admit)

    def _copy(self, src: int, req, match) -> None:
        """The copy as commands: the blocks into req's table; for a sliding-window
        model, the window's pages at the prefix's end (the source's lookup reached only
        where they are cached; req holds pages from there on); for a linear-attention
        one, the state the prefix ends with (its lookup reached only a boundary that has
        a snapshot)."""
        dst, m = self.ranks.kv(req.rank), len(match.blocks)
        src_blocks, dst_blocks = [match.blocks], [dst.table(req.request_id)[:m]]
        if dst.window is not None and len(match.window_pages):
            first = m - len(match.window_pages)  # the logical blocks of those pages
            for group in range(dst.window.pages_per_block):
                pages = dst.window_table(req.request_id, group)[first:m]
                held = pages >= 0
                src_blocks.append(match.window_pages[held, group])
                dst_blocks.append(pages[held])
        self.outbox.copy_blocks(src, req.rank, np.concatenate(src_blocks),
                                np.concatenate(dst_blocks))
        if dst.snapshots is not None:
            key = req.keys.key(m - 1)
            self.outbox.send(FetchState(src, req.rank, key, req.request_id, match.num_tokens))
