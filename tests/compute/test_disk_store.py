"""The disk tier's block files: round trips, reopening, crashes mid-write, corruption."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from labkit.engine.compute.disk_store import HEADER, MAGIC, VERSION, DiskBlockStore

ROOT = Path(__file__).resolve().parents[2]


def _block(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(6, 8, generator=g)
    cache = torch.randn(4, 16, 2, 8, generator=g).to(torch.bfloat16)
    return {
        "gpu0.layer0.k": torch.randn(16, 2, 8, generator=g),
        "gpu0.layer0.v": cache[2],  # a contiguous view at an offset into a bigger cache
        "gpu1.layer0.k": base.t(),  # non-contiguous
        "gpu1.layer0.v": base[:, ::2].to(torch.float16),
        "gpu1.layer1.latent": cache[1, :, 0],  # non-contiguous bf16
        "pos": torch.randint(-2**31, 2**31 - 1, (5, 3), generator=g, dtype=torch.int32),
        "whole": base,  # overlaps the next: safetensors refuses shared storage
        "rows": base[1:3],
        "empty": torch.zeros(0, 3),
        "scalar": torch.tensor(3.5, dtype=torch.bfloat16),
    }


def _assert_same(got: dict[str, torch.Tensor] | None, want: dict[str, torch.Tensor]) -> None:
    assert got is not None and set(got) == set(want)
    for name, w in want.items():
        g = got[name]
        assert g.device.type == "cpu" and g.dtype == w.dtype and g.shape == w.shape, name
        # Compare bit patterns, so that bf16/f16 and any NaN are checked exactly.
        assert torch.equal(g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)), name


def _block_files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_round_trip_overwrite_delete(tmp_path):
    store = DiskBlockStore(tmp_path / "kv")
    keys = [0, 7, -1, -2**63, 2**63 - 1, 0x1234_5678_9ABC_DEF0]
    blocks = {k: _block(i) for i, k in enumerate(keys)}
    written = {k: store.write(k, b) for k, b in blocks.items()}
    for k, b in blocks.items():
        _assert_same(store.read(k), b)
        assert k in store
        assert written[k] == store.path(k).stat().st_size
        assert written[k] > DiskBlockStore.block_nbytes(b)
    assert len(store) == len(keys) and store.keys() == sorted(keys)
    assert store.nbytes == sum(written.values())
    # -1 and 2**64 - 1 share a bit pattern: only the signed form is a key.
    assert store.path(-1).name == "ffffffffffffffff.kvb"
    with pytest.raises(ValueError):
        store.write(2**64 - 1, blocks[0])
    assert 12345 not in store and store.read(12345) is None

    new = {"x": torch.arange(10, dtype=torch.int32)}
    n = store.write(-1, new)
    _assert_same(store.read(-1), new)
    assert store.nbytes == sum(written.values()) - written[-1] + n and len(store) == len(keys)

    assert store.delete(7) and not store.delete(7)
    assert 7 not in store and store.read(7) is None and not store.path(7).exists()
    assert store.keys() == sorted(set(keys) - {7})
    assert store.nbytes == sum(p.stat().st_size for p in (tmp_path / "kv").iterdir())


def test_block_nbytes_counts_tensor_bytes():
    b = {"k": torch.zeros(16, 2, 8), "v": torch.zeros(16, 2, 8, dtype=torch.bfloat16)}
    assert DiskBlockStore.block_nbytes(b) == 16 * 2 * 8 * (4 + 2)


def test_reopen_finds_blocks(tmp_path):
    first = DiskBlockStore(tmp_path)
    blocks = {k: _block(k & 0xFF) for k in (3, -5, 2**62)}
    for k, b in blocks.items():
        first.write(k, b)
    (tmp_path / "notes.txt").write_text("not a block")  # foreign files are left alone
    second = DiskBlockStore(tmp_path)
    assert second.keys() == sorted(blocks) and second.nbytes == first.nbytes
    for k, b in blocks.items():
        _assert_same(second.read(k), b)
    assert (tmp_path / "notes.txt").exists()


_CRASH = """
import os, signal, torch
import labkit.engine.compute.disk_store as ds
store = ds.DiskBlockStore({d!r})
store.write(1, {{"k": torch.arange(1000, dtype=torch.float32)}})
real, calls = os.write, []
def die_mid_payload(fd, data):  # the header goes through, then half the payload
    calls.append(fd)
    if len(calls) == 1:
        return real(fd, data)
    real(fd, bytes(data)[: len(data) // 2])
    os.kill(os.getpid(), signal.SIGKILL)
ds.os.write = die_mid_payload
store.write(2, {{"k": torch.arange(1000, dtype=torch.float32) * 2}})
"""


def test_crash_mid_write_leaves_no_trace(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _CRASH.format(d=str(tmp_path))], cwd=ROOT,
                          capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    # The child died holding a half-written temp file, never renamed.
    tmp = [n for n in _block_files(tmp_path) if n.startswith(".tmp-")]
    assert len(tmp) == 1 and HEADER.size < (tmp_path / tmp[0]).stat().st_size < 4000
    store = DiskBlockStore(tmp_path)
    assert store.keys() == [1] and 2 not in store and store.read(2) is None
    _assert_same(store.read(1), {"k": torch.arange(1000, dtype=torch.float32)})
    assert _block_files(tmp_path) == [store.path(1).name]


def test_live_writers_temp_file_is_kept(tmp_path):
    # Another live process's in-flight write is not an interrupted one.
    parent = tmp_path / f".tmp-{5:016x}-{os.getppid()}-1"
    dead = tmp_path / f".tmp-{6:016x}-{2**22 + 12345}-1"  # above Linux's pid_max default
    parent.write_bytes(b"half")
    dead.write_bytes(b"half")
    DiskBlockStore(tmp_path)
    assert parent.exists() and not dead.exists()


def _corrupt_flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[HEADER.size + len(data[HEADER.size:]) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _corrupt_truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 7])


def _corrupt_magic(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(b"XKVB" + data[4:])


def _corrupt_version(path: Path) -> None:
    data = bytearray(path.read_bytes())
    HEADER.pack_into(data, 0, MAGIC, VERSION + 1, *HEADER.unpack_from(data)[2:])
    path.write_bytes(bytes(data))


def _corrupt_short(path: Path) -> None:
    path.write_bytes(MAGIC)


def _corrupt_appended(path: Path) -> None:
    path.write_bytes(path.read_bytes() + b"\0")


@pytest.mark.parametrize("corrupt", [_corrupt_flip, _corrupt_truncate, _corrupt_magic,
                                     _corrupt_version, _corrupt_short, _corrupt_appended])
@pytest.mark.parametrize("reopen", [False, True])
def test_corrupt_file_is_never_served(tmp_path, corrupt, reopen):
    store = DiskBlockStore(tmp_path)
    good = {"k": torch.randn(64, 8)}
    store.write(10, good)
    store.write(-10, good)
    corrupt(store.path(10))
    if reopen:
        store = DiskBlockStore(tmp_path)
    assert store.read(10) is None
    assert not store.path(10).exists() and 10 not in store and store.keys() == [-10]
    assert store.nbytes == store.path(-10).stat().st_size
    _assert_same(store.read(-10), good)


def test_file_under_another_keys_name_is_rejected(tmp_path):
    store = DiskBlockStore(tmp_path)
    store.write(1, {"k": torch.ones(4)})
    store.write(2, {"k": torch.zeros(4)})
    os.replace(store.path(1), store.path(2))  # block 1's bytes, under key 2's name
    store = DiskBlockStore(tmp_path)
    assert store.keys() == [2] and store.read(2) is None and len(store) == 0


def test_unreadable_tensor_name_is_refused_before_writing(tmp_path):
    store = DiskBlockStore(tmp_path)
    with pytest.raises(ValueError):
        store.write(1, {"__metadata__": torch.zeros(2)})
    assert len(store) == 0 and _block_files(tmp_path) == []
