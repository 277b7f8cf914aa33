"""What engines leave behind: freed by the cycle collector, so collect when grown.

An engine sits in reference cycles -- its parts subscribe to its event bus, which
points back at them -- so an engine nobody names any more is freed only by Python's
cycle collector. That collector runs on counts of objects allocated, not bytes: a
process that runs engine after engine (a planner's worker, a P/D ratio sweep, a test
worker) grows by the engines' tables and caches, tens to hundreds of MB each, before a
full collection comes (a `labkit plan` worker grew 42 MB a point, linearly, for 24
points; a test worker making compute engines reached 18 GB and was killed).

`collect_if_grown` runs a full collection when the process is `grown_mb` more resident
than after the last one: a read of /proc when nothing piled up, ~0.1-0.3 s when it
runs. Every new `Engine` calls it first, so a loop making engines holds at most about
`GROWN_MB` of dropped ones, whoever wrote the loop. `Engine.close()` frees a compute
engine's tensors at once; this is for the rest.
"""

from __future__ import annotations

import gc
import os

GROWN_MB = 512
_after_last_mb: list[float] = []  # resident MB after the last collection (or the first look)


def resident_mb() -> float | None:
    """This process's resident memory in MB (None where /proc is not there)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return None


def collect_if_grown(grown_mb: float | None = None) -> bool:
    """Collect reference cycles if this process grew `grown_mb` (default `GROWN_MB`)
    since the last collection (always, where its size cannot be read); returns whether
    it did."""
    grown_mb = GROWN_MB if grown_mb is None else grown_mb
    now = resident_mb()
    if now is not None and not _after_last_mb:
        _after_last_mb.append(now)
    if now is not None and now <= _after_last_mb[0] + grown_mb:
        return False
    gc.collect()
    after = resident_mb()
    if after is not None:
        _after_last_mb[:] = [after]
    return True
