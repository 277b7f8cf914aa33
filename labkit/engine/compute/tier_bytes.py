"""The bytes behind the KV offload tiers: host tensors and block files.

The control plane decides which block goes where (`engine/kv/tiers.py`) and reports
each decision as a `Move`; this module makes it true on real tensors. A block's bytes
are, for every GPU of a DP replica and every attention layer it holds, that GPU's slice
of one paged block (under DCP, its shard of the block's tokens; under TP, its heads) —
gathered into one dict of tensors, named `"<gpu in replica>.<layer>.<name>"`.

- **host (CPU) tier**: a dict key -> that block dict, in CPU memory (pinned when the
  GPUs are CUDA devices, so that copies can run asynchronously);
- **disk tier**: a `DiskBlockStore` per node store, one checksummed file per block,
  written atomically (`disk_store.py`), in this engine's own folder of the namespace
  of what makes its KV identical (`kv_namespace.py`).

A "store" copies GPU -> host, a "demote" writes host -> file and frees the host copy,
a "load" copies the tier's bytes into the GPU blocks the KV manager allocated.

The disk tier is a cache, so its failures cost recomputation, never a wrong token or a
lost run:

- a damaged block file is never served. `intact` reads a block when a load is first
  offered; `fetch` reads every disk block of a load again when it is admitted and keeps
  the bytes for the load itself, so a file damaged in between is caught too. The
  control plane forgets a damaged block and recomputes from it on;
- a write that fails (a read-only or full `kv_offload_dir`) leaves the block out of the
  tier: `__call__` returns the keys it could not write, the control plane forgets them
  (``disk_tier_unwritable_blocks`` in summaries), and a `TierWarning` names the knob and
  the folder, once. The blocks already on disk keep being served.

With ``kv_offload_strict=True`` either failure stops the run instead (`TierCorruption`,
`TierWriteError`).
"""

from __future__ import annotations

import shutil
import tempfile
import warnings
import weakref
from pathlib import Path

import torch

from labkit.engine.compute.disk_store import DiskBlockStore
from labkit.engine.compute.kv_namespace import EngineFolder, namespace_digest


class TierCorruption(RuntimeError):
    """A block the control plane placed on disk could not be read back intact."""


class TierWriteError(RuntimeError):
    """kv_offload_strict: the disk tier could not write a block."""


class TierWarning(RuntimeWarning):
    """The disk tier degraded: blocks it cannot write are recomputed when needed."""


STRICT_HINT = "set kv_offload_strict=True (--kv-offload-strict) to stop instead"


class TierBytes:
    def __init__(self, plane, directory: str | None = None, identity: dict | None = None,
                 strict: bool = False) -> None:
        """`plane`: the ComputeDataPlane (its ranks' paged caches and its mesh);
        `directory`: the user's kv_offload_dir (default: a temporary one, removed by
        `close`); `identity`: what the KV bytes depend on (`kv_namespace.kv_identity`);
        `strict`: fail instead of degrading."""
        self.plane = plane
        self.strict = strict
        self.identity = identity or {}
        self.root = Path(tempfile.mkdtemp(prefix="labkit-kv-") if directory is None
                         else directory)
        # a temporary directory goes with the engine (or the interpreter), files and all
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.root, True) \
            if directory is None else None
        self.host: dict[int, dict[int, dict[str, torch.Tensor]]] = {}  # store -> key -> block
        self.disks: dict[int, DiskBlockStore] = {}
        self._folder: EngineFolder | None = None
        self._staged: dict[tuple[int, int], dict[str, torch.Tensor]] = {}  # fetched to load
        self.unwritable_blocks = 0
        self._warned = False
        self._pin = plane.device.type == "cuda"

    @property
    def directory(self) -> Path:
        """This engine's folder of disk-tier files (made on first use)."""
        if self._folder is None:
            self._folder = EngineFolder(self.root, self.identity)
        return self._folder.path

    def disk(self, store: int) -> DiskBlockStore:
        if store not in self.disks:
            self.disks[store] = DiskBlockStore(self.directory / f"store-{store}",
                                               namespace_digest(self.identity))
        return self.disks[store]

    # ---------------------------------------------------------------- moves
    def __call__(self, store: int, moves) -> list[int]:
        """Mirror the moves; returns the keys the disk tier could not write."""
        host = self.host.setdefault(store, {})
        unwritten = []
        for m in moves:
            if m.kind == "store":
                host[m.key] = self.read_gpu(m.rank, m.block)
            elif m.kind == "demote":
                if not self._write(store, m.key, host.pop(m.key)):
                    unwritten.append(m.key)
            elif m.kind in ("drop", "discard"):
                if m.tier == "cpu":
                    del host[m.key]
                elif store in self.disks:  # (none when the folder could not be made)
                    self.disks[store].delete(m.key)
            elif m.kind == "load":
                block = host[m.key] if m.tier == "cpu" else \
                    self._staged.pop((store, m.key), None) or self._read_disk(store, m.key)
                self.write_gpu(m.rank, m.block, block)
            else:
                raise ValueError(f"unknown tier move {m.kind!r}")
        return unwritten

    def _write(self, store: int, key: int, block: dict[str, torch.Tensor]) -> bool:
        try:
            self.disk(store).write(key, block)
            return True
        except OSError as err:
            self.unwritable_blocks += 1
            where = f"kv_offload_dir (--kv-offload-dir) {self.root}"
            if self.strict:
                raise TierWriteError(f"{where}: cannot write KV blocks ({err.strerror or err})"
                                     f"; kv_offload_strict is set") from err
            if not self._warned:
                self._warned = True
                warnings.warn(f"{where}: cannot write KV blocks ({err.strerror or err}); the "
                              f"disk tier keeps serving the blocks it holds and recomputes "
                              f"the others ({STRICT_HINT})", TierWarning, stacklevel=2)
            return False

    # -------------------------------------------------------------- reading
    def intact(self, store: int, key: int) -> bool:
        """Can the disk block be read back? (A corrupt file is deleted on the way.)"""
        return self._read(store, key) is not None

    def fetch(self, store: int, keys: list[int]) -> list[int]:
        """Read the disk blocks of a load about to start and keep their bytes for it;
        returns the keys that could not be read intact (then nothing is kept)."""
        blocks = {key: self._read(store, key) for key in keys}
        bad = [key for key, block in blocks.items() if block is None]
        if not bad:
            self._staged = {(store, key): block for key, block in blocks.items()}
        return bad

    def _read(self, store: int, key: int) -> dict[str, torch.Tensor] | None:
        block = self.disk(store).read(key)
        if block is None and self.strict:
            raise TierCorruption(f"KV block {key:#x} on the disk tier "
                                 f"({self.disk(store).path(key)}) is missing or failed its "
                                 f"checksum; kv_offload_strict is set")
        return block

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
        self._staged.clear()
        if self._folder is not None:
            self._folder.close()
        if self._cleanup is not None:
            self._cleanup()
