"""The disk tier of KV offload: KV blocks kept as files, one per block, in a directory.

A block is a small dict of named tensors (for every GPU of a replica and every layer, that
GPU's slice of one paged block), stored under an int key — a 64-bit block hash. The disk
tier is a cache: losing a block only costs recomputing it, but serving a wrong one would
silently corrupt generations. So the store trades availability for integrity:

- a block file appears complete or not at all: it is written under a temporary name in
  the same directory, fsynced, then renamed over the final name (rename is atomic within
  a filesystem), and the directory is fsynced so the rename itself survives a crash;
- temporary files are never read; the ones a crashed writer left behind are removed when
  a store opens the directory;
- each file carries its key, its payload's length and a blake2b-256 digest of it; a read
  that finds any of them wrong (bit rot, a truncated or foreign file) deletes the file
  and reports the block absent. A store opened with a `namespace` (what makes its KV
  identical: `kv_namespace.py`) keys the digest with it, so a file written by an engine
  with other weights, layout or dtype fails the check even under the right name.

File layout (little-endian): a 56-byte header — magic `LKVB`, format version (u16),
reserved (u16, 0), key (i64), payload length (u64), blake2b-256 digest of the payload —
then the payload, a safetensors serialisation of the dict (names, dtypes, shapes and raw
bytes, no pickle). Files are named by the key as unsigned 64-bit hex: `<16 hex>.kvb`.

Opening a directory indexes its block files by name and size without reading them:
checking every file up front would read the whole tier; corruption is caught at read.
"""

from __future__ import annotations

import hashlib
import operator
import os
import re
import struct
import threading
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from labkit.engine.kv.block_check import file_digest

MAGIC = b"LKVB"
VERSION = 1
HEADER = struct.Struct("<4sHHqQ32s")  # magic, version, reserved, key, length, digest
SUFFIX = ".kvb"
TMP_PREFIX = ".tmp-"

_MASK = 2**64 - 1
_BLOCK_NAME = re.compile(r"([0-9a-f]{16})\.kvb")
_TMP_NAME = re.compile(r"\.tmp-[0-9a-f]{16}-(\d+)-\d+")


class DiskBlockStore:
    def __init__(self, directory: str | os.PathLike, namespace: bytes = b"") -> None:
        self.directory = Path(directory)
        self.namespace = namespace  # keys the digest (at most 64 bytes; b"": unkeyed)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._sizes: dict[int, int] = {}  # key -> file size of its complete block file
        self._nbytes = 0
        for entry in os.scandir(self.directory):
            if (m := _BLOCK_NAME.fullmatch(entry.name)) and entry.is_file():
                self._remember(_signed(int(m.group(1), 16)), entry.stat().st_size)
            elif (m := _TMP_NAME.fullmatch(entry.name)) and not _other_live_writer(
                    int(m.group(1))):
                _unlink(entry.path)

    # ------------------------------------------------------------ index
    def __contains__(self, key: int) -> bool:
        with self._lock:
            return _check_key(key) in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def keys(self) -> list[int]:
        with self._lock:
            return sorted(self._sizes)

    @property
    def nbytes(self) -> int:
        """Bytes of the complete block files (headers included)."""
        return self._nbytes

    @staticmethod
    def block_nbytes(tensors: dict[str, torch.Tensor]) -> int:
        """Tensor bytes of a block: what the tier holds per block, before each file's
        overhead (the 56-byte header plus safetensors' JSON header, ~80 bytes a tensor)."""
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def _remember(self, key: int, size: int) -> None:
        self._nbytes += size - self._sizes.get(key, 0)
        self._sizes[key] = size

    def _forget(self, key: int) -> None:
        self._nbytes -= self._sizes.pop(key, 0)

    def path(self, key: int) -> Path:
        return self.directory / f"{_check_key(key) & _MASK:016x}{SUFFIX}"

    # ------------------------------------------------------------ writing
    def write(self, key: int, tensors: dict[str, torch.Tensor]) -> int:
        """Store (or replace) block `key`; returns the bytes written."""
        return self.write_checked(key, tensors)[0]

    def write_checked(self, key: int, tensors: dict[str, torch.Tensor]) -> tuple[int, bytes]:
        """`write`, also returning the digest of the whole file (`kv/block_check.py`)."""
        key = _check_key(key)
        payload = st_save(_packed(tensors))
        header = HEADER.pack(MAGIC, VERSION, 0, key, len(payload),
                             _digest(payload, self.namespace))
        final = self.path(key)
        tmp = self.directory / (f"{TMP_PREFIX}{key & _MASK:016x}-{os.getpid()}-"
                                f"{threading.get_native_id()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            try:
                _write_all(fd, header)
                _write_all(fd, payload)
                os.fsync(fd)  # the bytes must be on disk before the name points at them
            finally:
                os.close(fd)
            with self._lock:  # a corrupt-read's delete must not race the new file in
                os.replace(tmp, final)
                self._remember(key, len(header) + len(payload))
        except BaseException:
            _unlink(tmp)
            raise
        self._sync_directory()
        return len(header) + len(payload), file_digest(header + payload)

    def _sync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def delete(self, key: int) -> bool:
        """Drop block `key`; False when it was not stored. No directory fsync: a delete
        that a crash undoes brings back a block that is still valid."""
        key = _check_key(key)
        with self._lock:
            if key not in self._sizes:
                return False
            self._forget(key)
            _unlink(self.path(key))
            return True

    # ------------------------------------------------------------ reading
    def read(self, key: int) -> dict[str, torch.Tensor] | None:
        """Block `key`'s tensors (on the CPU), or None when it is absent or its file fails
        a check — in which case the file is deleted, so it is never served."""
        key = _check_key(key)
        if key not in self._sizes:
            return None
        path = self.path(key)
        try:
            f = open(path, "rb")
        except FileNotFoundError:  # removed behind our back
            with self._lock:
                self._forget(key)
            return None
        with f:
            tensors = _parse(f, key, self.namespace)
            if tensors is None:
                self._drop_corrupt(key, path, os.fstat(f.fileno()))
        return tensors

    def _drop_corrupt(self, key: int, path: Path, seen: os.stat_result) -> None:
        with self._lock:
            try:
                now = os.stat(path)
            except FileNotFoundError:
                now = None
            # Only delete the file we judged: a writer may have renamed a good one in since.
            if now is not None and (now.st_ino, now.st_dev) == (seen.st_ino, seen.st_dev):
                _unlink(path)
                self._forget(key)
            elif now is None:
                self._forget(key)


# ---------------------------------------------------------------- helpers
def _check_key(key: int) -> int:
    key = operator.index(key)  # numpy ints too, but not floats
    if not -2**63 <= key < 2**63:
        raise ValueError(f"block key {key} is not a signed 64-bit integer "
                         "(store an unsigned hash h as h - 2**64 when h >= 2**63)")
    return key


def _signed(u: int) -> int:
    return u - 2**64 if u >= 2**63 else u


def _packed(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors as safetensors accepts them: on the CPU, contiguous, no two sharing
    storage (it refuses overlapping views, e.g. one buffer under two names)."""
    if "__metadata__" in tensors:  # safetensors' reserved header entry: unreadable file
        raise ValueError("'__metadata__' cannot name a tensor")
    out, seen = {}, set()
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            t = t.clone()
        seen.add(ptr)
        out[name] = t
    return out


def _digest(payload: bytes, namespace: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=32, key=namespace).digest()


def _parse(f, key: int, namespace: bytes = b"") -> dict[str, torch.Tensor] | None:
    header = f.read(HEADER.size)
    if len(header) != HEADER.size:
        return None
    magic, version, _, stored_key, length, digest = HEADER.unpack(header)
    if magic != MAGIC or version != VERSION or stored_key != key:
        return None
    payload = f.read(length)
    if len(payload) != length or f.read(1):  # truncated, or trailing bytes
        return None
    if _digest(payload, namespace) != digest:
        return None
    try:
        return st_load(payload)
    except Exception:  # a digest-valid payload that still does not parse: a writer bug
        return None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:  # os.write may write less than asked
        view = view[os.write(fd, view):]


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _other_live_writer(pid: int) -> bool:
    """Whether a temp file's writer may still be writing it: another process that is
    alive. Our own pid counts as dead — a restarted container often reuses it."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    except OSError:
        return False
    return True
