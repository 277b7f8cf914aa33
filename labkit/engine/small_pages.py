"""Zeroed arrays whose memory the kernel hands out a small page at a time.

numpy advises the kernel to back arrays of 4 MiB and more with huge pages (2 MiB),
which pays for arrays written through at once. Two of the simulator's arrays are not:
a prefix cache's key array is written sparsely (a prompt's keys are a few runs of
consecutive numbers among millions), and the steps table grows a step at a time into
room reserved for it. Under huge pages each first write there zeroes — and, on a busy
host whose free memory is fragmented, first compacts — a whole 2 MiB page; on the fast
workload of `labkit bench sim` that was a tenth of the replay's CPU time, in the
kernel. `zeros` maps anonymous private memory advised against huge pages instead: a
page costs memory only once written, 4 KiB at a time.
"""

from __future__ import annotations

import mmap

import numpy as np


def zeros(shape, dtype) -> np.ndarray:
    """np.zeros(shape, dtype), its pages small and taken when first written."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    if not hasattr(mmap, "MAP_PRIVATE"):  # (not a POSIX system)
        return np.zeros(shape, dtype=dtype)
    memory = mmap.mmap(-1, max(count, 1) * dtype.itemsize,
                       flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # (Linux)
        memory.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(memory, dtype=dtype, count=count).reshape(shape)
