"""The bytes behind the KV offload tiers: host tensors and block files.

The control plane decides which block goes where (`engine/kv/tiers.py`) and sends each
decision as a `Move`, in a `TierMoves` step command (`step_io.py`); this module makes it
true on real tensors. The blocks are read from and written to the GPUs through the
plane's executor (`read_kv_block` / `write_kv_block`), so the ranks may be threads of
this process or processes of their own (`executor="mp"`). A block's bytes
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

- a damaged block file is never served. Every block file written is reported back
  (`DiskWrite`: its path and the digest of its bytes); the control plane checks the
  file against it when a load is first offered and again when it starts
  (`kv/block_check.py`), forgets a damaged block, sends a "discard" for its file and
  recomputes from it on. A load that still meets a bad file raises `TierCorruption`;
- a write that fails (a read-only or full `kv_offload_dir`) leaves the block out of the
  tier: it is reported with no path, the control plane forgets it
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
from labkit.engine.compute.executors import read_kv_block, write_kv_block
from labkit.engine.compute.kv_namespace import EngineFolder, namespace_digest
from labkit.engine.kv.block_check import TierCorruption
from labkit.engine.step_io import DiskWrite

__all__ = ["TierBytes", "TierCorruption", "TierWarning", "TierWriteError"]


class TierWriteError(RuntimeError):
    """kv_offload_strict: the disk tier could not write a block."""


class TierWarning(RuntimeWarning):
    """The disk tier degraded: blocks it cannot write are recomputed when needed."""


STRICT_HINT = "set kv_offload_strict=True (--kv-offload-strict) to stop instead"


class TierBytes:
    def __init__(self, plane, directory: str | None = None, identity: dict | None = None,
                 strict: bool = False) -> None:
        """`plane`: the ComputeDataPlane (its mesh, and its executor, through which the
        GPU blocks are read and written);
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
    def __call__(self, store: int, moves) -> list[DiskWrite]:
        """Mirror the moves; returns what was written to disk (or could not be)."""
        host = self.host.setdefault(store, {})
        written = []
        for m in moves:
            if m.kind == "store":
                host[m.key] = self.read_gpu(m.rank, m.block)
            elif m.kind == "demote":
                written.append(self._write(store, m.key, host.pop(m.key)))
            elif m.kind in ("drop", "discard"):
                if m.tier == "cpu":
                    del host[m.key]
                elif store in self.disks:  # (none when the folder could not be made)
                    self.disks[store].delete(m.key)
            elif m.kind == "load":
                block = host[m.key] if m.tier == "cpu" else self._read_disk(store, m.key)
                self.write_gpu(m.rank, m.block, block)
            else:
                raise ValueError(f"unknown tier move {m.kind!r}")
        return written

    def _write(self, store: int, key: int, block: dict[str, torch.Tensor]) -> DiskWrite:
        try:
            disk = self.disk(store)
            _, digest = disk.write_checked(key, block)
            return DiskWrite(store, key, str(disk.path(key)), digest)
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
            return DiskWrite(store, key)

    # -------------------------------------------------------------- reading
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
        gpus = self.plane.mesh.replica_gpus(dp_rank)
        parts = self.plane.executor.run(read_kv_block, [(block,)] * len(gpus), gpus)
        out = {}
        for i, part in enumerate(parts):
            for name, t in part.items():
                out[f"{i}.{name}"] = t.pin_memory() if self._pin else t
        return out

    def write_gpu(self, dp_rank: int, block: int, data: dict[str, torch.Tensor]) -> None:
        gpus = self.plane.mesh.replica_gpus(dp_rank)
        parts = [{name[len(f"{i}."):]: t for name, t in data.items()
                  if name.startswith(f"{i}.")} for i in range(len(gpus))]
        self.plane.executor.run(write_kv_block, [(block, p) for p in parts], gpus)

    def close(self) -> None:
        self.host.clear()
        if self._folder is not None:
            self._folder.close()
        if self._cleanup is not None:
            self._cleanup()
