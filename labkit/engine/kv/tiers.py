"""KV offload tiers: CPU DRAM, then disk, below the GPUs of a node.

Agentic sessions keep far more reusable context than GPU memory holds: between two
calls of a session, its KV is often evicted from the GPU's prefix cache. A node's host
memory (terabytes) and its NVMe drives (tens of terabytes) can keep it, in the manner
of LMCache or a Mooncake store:

- **store (write-through).** Every block the prefix cache registers — a full block,
  named by its chained key — is also copied to the CPU tier (asynchronously: the copy
  overlaps the next steps and is not on any request's path). A key already there is
  only touched.
- **eviction cascades down.** A full CPU tier evicts by its policy (LRU or ARC, see
  `eviction.py`); an evicted block moves to the disk tier if there is one, else it is
  gone. A full disk tier drops its victims.
- **lookup.** On admission, after the GPU's own prefix match, the next keys of the
  request are looked up tier by tier; the run of consecutive keys found (in any tier)
  is what could be loaded.
- **load or recompute.** Loading costs, per tier, a latency plus bytes over the
  slowest link: each GPU pulls its own share over its PCIe link (host DRAM), the disk
  blocks also cross the node's NVMe bandwidth. The engine compares that with the cost
  model's time to prefill the same tokens and loads only when it is cheaper. A load
  overlaps other requests' steps (the request waits, the GPU does not) — and when
  nothing else runs, the GPU simply waits for it.

`NodeStore` is the tiers of one node, shared by its DP ranks; it keeps per-tier
statistics (stored, hit, evicted, dropped blocks and bytes) that the metrics report
and the property tests balance. Which bytes really move is the data plane's business:
the compute plane copies tensors on every `moves` it is told about.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from labkit.engine.kv.eviction import EvictionPolicy, make_policy


@dataclass(slots=True)
class TierStats:
    stored_blocks: int = 0  # blocks written into the tier (from the GPU or the tier above)
    hit_blocks: int = 0  # blocks loaded from it back to a GPU
    evicted_blocks: int = 0  # blocks it let go of (demoted or dropped)
    dropped_blocks: int = 0  # of those, the ones no tier kept
    promoted_blocks: int = 0  # blocks that left it for the tier above (loaded, hot again)
    corrupt_blocks: int = 0  # blocks found unreadable when offered or loaded (compute plane)
    unwritable_blocks: int = 0  # blocks the tier could not write (compute plane: disk full)

    def resident(self) -> int:
        return (self.stored_blocks - self.evicted_blocks - self.promoted_blocks
                - self.corrupt_blocks - self.unwritable_blocks)


@dataclass(slots=True)
class Tier:
    name: str  # "cpu" | "disk"
    capacity_blocks: int
    bandwidth: float  # bytes/s of its link to the GPUs (host: each GPU's PCIe; disk: node)
    latency_s: float
    policy_name: str = "lru"
    stats: TierStats = field(default_factory=TierStats)
    policy: EvictionPolicy = field(init=False)

    def __post_init__(self) -> None:
        self.policy = make_policy(self.policy_name, self.capacity_blocks)

    def __contains__(self, key: int) -> bool:
        return key in self.policy

    def __len__(self) -> int:
        return len(self.policy)


@dataclass(slots=True)
class Move:
    """One block changing place, for the data plane to mirror with bytes:

    - "store": from GPU block `block` of DP rank `rank` into `tier`;
    - "demote": from `tier` into the tier below it;
    - "drop": out of `tier`, kept nowhere below;
    - "load": from `tier` into GPU block `block` of DP rank `rank` (the tier keeps it);
    - "discard": out of `tier` because the tier above took it back (one copy per node).
    """

    kind: str
    key: int
    tier: str
    rank: int = -1
    block: int = -1


class NodeStore:
    def __init__(self, index: int, tiers: list[Tier], block_bytes: float,
                 block_bytes_per_gpu: float, copy_overhead_s=None) -> None:
        self.index = index
        self.tiers = tiers
        self.block_bytes = block_bytes  # one copy of a block's KV, all layers
        self.block_bytes_per_gpu = block_bytes_per_gpu  # what one GPU holds of it
        # issuing the copies of n blocks on one GPU (per-layer vs packed: kv/packing.py)
        self.copy_overhead_s = copy_overhead_s or (lambda n: 0.0)
        self._level: dict[int, int] = {}  # key -> index of the tier holding it
        self.version = 0  # bumped whenever a key enters, leaves or changes tier

    # ---------------------------------------------------------------- store
    def store(self, keys, rank: int, blocks) -> list[Move]:
        """Write-through of newly cached GPU blocks (`blocks` of DP rank `rank`, named
        by `keys`); returns every block move made, in order."""
        moves: list[Move] = []
        top = self.tiers[0]
        for key, block in zip(keys, blocks):
            key = int(key)
            if key in top:
                top.policy.touch(key)
                continue
            moves.append(Move("store", key, top.name, rank, int(block)))
            self._insert(0, key, moves)
        return moves

    def _insert(self, level: int, key: int, moves: list[Move]) -> None:
        tier = self.tiers[level]
        below = self.tiers[level + 1] if level + 1 < len(self.tiers) else None
        if below is not None and key in below:
            below.policy.discard(key)  # back in the tier above: one copy per node
            below.stats.promoted_blocks += 1
            moves.append(Move("discard", key, below.name))
        tier.stats.stored_blocks += 1
        self._level[key] = level
        self.version += 1
        for victim in tier.policy.insert(key):
            tier.stats.evicted_blocks += 1
            if below is None:
                tier.stats.dropped_blocks += 1
                del self._level[victim]
                moves.append(Move("drop", victim, tier.name))
            else:
                moves.append(Move("demote", victim, tier.name))
                self._insert(level + 1, victim, moves)

    # --------------------------------------------------------------- lookup
    def locate(self, keys: list[int]) -> list[int]:
        """The tier (its index) of each of the leading keys found, up to the first miss.
        (Called for every waiting request at every step: one dict probe per key.)"""
        found, level = [], self._level.get
        for key in keys:
            where = level(key)
            if where is None:
                break
            found.append(where)
        return found

    def level(self, key: int) -> int | None:
        """The tier (its index) holding key, or None."""
        return self._level.get(key)

    def load_seconds(self, levels: list[int]) -> float:
        """Time to bring these blocks (tier indices, from `locate`) to the GPUs. Every
        block crosses each GPU's PCIe link (its share of the block); blocks on disk
        first cross the node's disk bandwidth. Each tier involved adds its latency."""
        if not levels:
            return 0.0
        host = self.tiers[0]
        seconds = host.latency_s + len(levels) * self.block_bytes_per_gpu / host.bandwidth \
            + self.copy_overhead_s(len(levels))
        for i, tier in enumerate(self.tiers[1:], start=1):
            n = levels.count(i)
            if n:
                seconds += tier.latency_s + n * self.block_bytes / tier.bandwidth
        return seconds

    def take(self, keys, rank: int, blocks) -> list[Move]:
        """Blocks (found by `locate`) loaded to GPU `blocks` of DP rank `rank`: count
        the hits; host blocks stay (touched); then disk blocks move back up to the host
        tier, hot again — after every load, since a promotion may push another of
        these blocks down or out."""
        moves, promoted = [], []
        for key, block in zip(keys, blocks):
            key, block = int(key), int(block)
            level = self._level[key]
            tier = self.tiers[level]
            tier.stats.hit_blocks += 1
            moves.append(Move("load", key, tier.name, rank, block))
            if level == 0:
                tier.policy.touch(key)
            else:
                promoted.append((key, block))
        for key, block in promoted:
            moves.append(Move("store", key, self.tiers[0].name, rank, block))
            self._insert(0, key, moves)
        return moves

    def forget(self, key: int, reason: str = "corrupt_blocks") -> None:
        """A block whose bytes turned out unreadable (or could not be written): it is in
        no tier any more; `reason` is the TierStats counter it adds to."""
        tier = self.tiers[self._level.pop(key)]
        tier.policy.discard(key)
        setattr(tier.stats, reason, getattr(tier.stats, reason) + 1)
        self.version += 1

    def stats(self) -> dict[str, TierStats]:
        return {t.name: t.stats for t in self.tiers}
