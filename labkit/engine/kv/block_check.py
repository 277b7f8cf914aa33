"""Checking a disk-tier block file from the control plane, without reading its tensors.

The disk tier is a cache that must never serve a wrong block (`compute/tier_bytes.py`).
Before the control plane offers or starts a load from disk it has to know that each
block's file still holds what was written — and it must know at once, since the load
decides what the step computes. So the data plane reports, for every block file it
writes, the file's path and a digest of its bytes (`step_io.DiskWrite`); the control
plane keeps them and checks a file by hashing it again. No call crosses into the data
plane, and nothing here needs torch: a file is bytes.

This is the same contract as the file's own header digest (`disk_store.py`), seen from
the other side: the header guards the data plane's read, this guards the control
plane's decision to read.
"""

from __future__ import annotations

import hashlib


class TierCorruption(RuntimeError):
    """A block the control plane placed on disk could not be read back intact."""


def file_digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=32).digest()


def file_intact(path: str, digest: bytes) -> bool:
    """Does the file at `path` still hold exactly the bytes that had `digest`?"""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:  # removed, or unreadable: not servable
        return False
    return file_digest(data) == digest
