"""Where a disk tier keeps its files: named by what makes KV identical, one folder per engine.

A block file is named by its block key, a hash of the tokens before it. Two engines
that compute different KV for the same tokens — other weights (another seed, another
checkpoint), another model, another layout (a block holds each GPU's shard), another
dtype or block size — must never read each other's files: the key would match, the
checksum too, and the wrong KV would be served without a word. So, as LMCache keys its
chunks by model, world size and worker:

- `kv_identity` lists what the bytes of a block depend on, and its digest names a
  **namespace** folder ``labkit-kv-<digest>`` (with a ``namespace.json`` saying what
  it holds); the digest also keys every block file's checksum (`DiskBlockStore`), so
  a file copied in from another namespace fails its check;
- inside it each engine writes into a folder of its own, ``run-<pid>-<random>``,
  locked (`flock`) while the engine lives: two engines sharing one `kv_offload_dir`
  never touch each other's files. A folder whose lock is free belongs to an engine
  that is gone (its disk tier started empty and its index died with it); the next
  engine to open the namespace removes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import secrets
import shutil
from pathlib import Path

import torch

FORMAT = 1  # bump when the block bytes' layout changes


def weights_identity(seed: int, checkpoint=None, weights: dict | None = None) -> str:
    """What the weights are: a checkpoint's files (path, size, modification time — not
    their bytes, which may be tens of GB), a digest of tensors given directly, or the
    seed of labkit's random weights."""
    if weights is not None:
        h = hashlib.blake2b(digest_size=16)
        for name in sorted(weights):
            t = weights[name].detach().to("cpu").contiguous()
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        return f"tensors:{h.hexdigest()}"
    if checkpoint is not None:
        path = Path(checkpoint).resolve()
        files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
        return "checkpoint:" + ",".join(
            f"{f}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
    return f"random:seed={seed}"


def kv_identity(spec, layout, dtype, kv_cache_dtype: str, block_size: int, device,
                weights: str) -> dict:
    """Everything a block's bytes depend on (see the module doc)."""
    return {"format": FORMAT, "model": spec.name,
            "architecture": hashlib.blake2b(repr(dataclasses.astuple(spec)).encode(),
                                            digest_size=16).hexdigest(),
            "weights": weights, "layout": layout.text, "dtype": str(dtype),
            "kv_cache_dtype": kv_cache_dtype, "block_size": block_size,
            "device": str(device).split(":")[0]}


def namespace_digest(identity: dict) -> bytes:
    return hashlib.blake2b(json.dumps(identity, sort_keys=True).encode(),
                           digest_size=16).digest()


class EngineFolder:
    """This engine's folder below `root` in the namespace of `identity`, locked while
    open; stale folders of engines that are gone are removed on the way."""

    def __init__(self, root: str | os.PathLike, identity: dict) -> None:
        self.namespace = namespace_digest(identity)
        space = Path(root) / f"labkit-kv-{self.namespace.hex()}"
        space.mkdir(parents=True, exist_ok=True)
        _write_once(space / "namespace.json", json.dumps(identity, indent=2, sort_keys=True))
        for old in space.glob("run-*"):
            _remove_if_unlocked(old)
        # made and locked under a name the clean-up above does not match, then renamed
        name = f"run-{os.getpid()}-{secrets.token_hex(4)}"
        making = space / f".{name}"
        making.mkdir()
        self._lock = os.open(making / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        self.path = space / name
        os.rename(making, self.path)

    def close(self) -> None:
        """Release the lock; the files stay until the next engine here removes them."""
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


def _write_once(path: Path, text: str) -> None:
    if path.exists():
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, path)


def _remove_if_unlocked(folder: Path) -> None:
    try:
        fd = os.open(folder / ".lock", os.O_RDWR)
    except FileNotFoundError:  # being created right now, or never locked: leave it
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return  # a live engine's
    with contextlib.suppress(OSError):
        shutil.rmtree(folder)
    os.close(fd)
