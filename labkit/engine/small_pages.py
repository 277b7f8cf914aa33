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

Such an array can also grow where it lies (`grow_in_place`): Linux enlarges the mapping
(mremap), the pages written move along with it and nothing is copied or touched. (A
copy scans the old array and writes every written page again: the prefix cache's key
arrays grew some fifty times in an agentic replay, and those copies were half its page
faults. Reserving the largest size up front instead is no way round: a process that
forks is charged for the whole of each private mapping it has written into, and test
workers holding many engines could then no longer start a subprocess.)
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


def grow_in_place(owner, name: str, count: int) -> bool:
    """Make `owner.<name>`, a 1-D array from `zeros`, `count` entries long (the new ones
    zero) by enlarging its mapping where it lies; False, the array left as it was,
    where that cannot be done: no mremap on this system, or the array is seen from
    elsewhere (another reference to it, or a view of it, pins its memory)."""
    array = getattr(owner, name)
    memory = _mapping(array)
    if memory is None or array.ndim != 1 or not array.flags.c_contiguous or \
            array.nbytes != len(memory):  # (a part of a mapping: not ours to move)
        return False
    dtype, old = array.dtype, len(array)
    setattr(owner, name, None)
    del array  # (and with it the view `zeros` made: the mapping is no longer exported)
    try:
        memory.resize(count * dtype.itemsize)
    except (BufferError, OSError, SystemError, ValueError):  # (then nothing changed)
        setattr(owner, name, np.frombuffer(memory, dtype=dtype, count=old))
        return False
    setattr(owner, name, np.frombuffer(memory, dtype=dtype, count=count))
    return True


def _mapping(array: np.ndarray) -> mmap.mmap | None:
    """The mapping an array from `zeros` lies in (through its views and the memoryview
    numpy reads it by), or None."""
    base = array.base
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    return base if isinstance(base, mmap.mmap) else None
