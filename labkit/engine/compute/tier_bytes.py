"""The bytes behind the KV offload tiers: host tensors and block files.

The control plane decides which block goes where (`engine/kv/tiers.py`) and reports
each decision as a `Move`; this module makes it true on real tensors. A block's bytes
are, for every GPU of a DP replica and every attention layer it holds, that GPU's slice
of one paged block (under DCP, its shard of the block's tokens; under TP, its heads) —
gathered into one dict of tensors, named `"<gpu in replica>.<layer>.<name>"`.

- **host (CPU) tier**: a dict key -> that block dict, in CPU memory (pinned when the
  GPUs are CUDA devices, so that copies can run asynchronously);
- **disk tier**: a `DiskBlockStore` per node store, one checksummed file per block,
  written atomically (`disk_store.py`).

A "store" copies GPU -> host, a "demote" writes host -> file and frees the host copy,
a "load" copies the tier's bytes into the GPU blocks the KV manager allocated. A disk
block that fails its checksum is never served: `intact` reads it when a load is first
offered, and the control plane forgets it and recomputes from there; a load that still
meets one (a file corrupted in between) stops with an error naming it.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from pathlib import Path

import torch

from labkit.engine.compute.disk_store import DiskBlockStore


class TierCorruption(RuntimeError):
    """A block the control plane placed on disk could not be read back intact."""


class TierBytes:
    def __init__(self, plane, directory: str | None = None) -> None:
        """`plane`: the ComputeDataPlane (its ranks' paged caches and its mesh);
        `directory`: where disk tiers keep their files (default: a temporary one,
        removed by `close`)."""
        self.plane = plane
        self.directory = Path(tempfile.mkdtemp(prefix="labkit-kv-") if directory is None
                              else directory)
        # a temporary directory goes with the engine (or the interpreter), files and all
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.directory, True) \
            if directory is None else None
        self.host: dict[int, dict[int, dict[str, torch.Tensor]]] = {}  # store -> key -> block
        self.disks: dict[int, DiskBlockStore] = {}
        self._pin = plane.device.type == "cuda"

    def disk(self, store: int) -> DiskBlockStore:
        if store not in self.disks:
            disk = DiskBlockStore(self.directory / f"labkit-kv-{store}")
            for key in list(disk.keys()):  # an earlier run's blocks: the index starts empty
                disk.delete(key)
            self.disks[store] = disk
        return self.disks[store]

    # ---------------------------------------------------------------- moves
    def __call__(self, store: int, moves) -> None:
        host = self.host.setdefault(store, {})
        for m in moves:
            if m.kind == "store":
                host[m.key] = self.read_gpu(m.rank, m.block)
            elif m.kind == "demote":
                self.disk(store).write(m.key, host.pop(m.key))
            elif m.kind in ("drop", "discard"):
                if m.tier == "cpu":
                    del host[m.key]
                else:
                    self.disk(store).delete(m.key)
            elif m.kind == "load":
                block = host[m.key] if m.tier == "cpu" else self._read_disk(store, m.key)
                self.write_gpu(m.rank, m.block, block)
            else:
                raise ValueError(f"unknown tier move {m.kind!r}")

    def intact(self, store: int, key: int) -> bool:
        """Can the disk block be read back? (A corrupt file is deleted on the way.)"""
        return self.disk(store).read(key) is not None

    def _read_disk(self, store: int, key: int) -> dict[str, torch.Tensor]:
        block = self.disk(store).read(key)
        if block is None:
            raise TierCorruption(
                f"KV block {key:#x} on the disk tier ({self.disk(store).path(key)}) is "
                f"missing or failed its checksum; it was not served")
        return block

    # ----------------------------------------------------------- GPU blocks
    def read_gpu(self, dp_rank: int, block: int) -> dict[str, torch.Tensor]:
        """One paged block of DP rank `dp_rank`, from every GPU of its replica."""
        out = {}
        for i, gpu in enumerate(self.plane.mesh.replica_gpus(dp_rank)):
            for layer, named in self.plane.ranks[gpu].kv.layers.items():
                for name, t in named.items():
                    copy = t[block].detach().to("cpu", copy=True)
                    out[f"{i}.{layer}.{name}"] = copy.pin_memory() if self._pin else copy
        return out

    def write_gpu(self, dp_rank: int, block: int, data: dict[str, torch.Tensor]) -> None:
        for i, gpu in enumerate(self.plane.mesh.replica_gpus(dp_rank)):
            for layer, named in self.plane.ranks[gpu].kv.layers.items():
                for name, t in named.items():
                    t[block].copy_(data[f"{i}.{layer}.{name}"], non_blocking=self._pin)

    def close(self) -> None:
        self.host.clear()
        if self._cleanup is not None:
            self._cleanup()
