"""Full garbage collections skip what existed before a replay.

CPython's cycle collector now and then (a full, generation-2 collection) walks every
container object the process holds. A replay allocates small objects by the million
but makes almost no cycles (a 600 s replay of the `labkit bench sim` fast workload
leaves ~500 unreachable objects in all), while what was there before it — the trace's
requests, the engine, a notebook's whole state — would be walked again at every full
collection. On that workload the collector took ~0.15-0.2 CPU s of ~4.5, two full
collections most of it (measured with `gc.callbacks`); with the old objects frozen,
~0.05 s.

So, for the length of a replay (`ReplayRun.finish`), what exists is moved out of the
collector's sight (`gc.freeze()`, as vLLM does once its engine is built). Nothing
changes what a replay computes. Afterwards the frozen objects return to the oldest
generation, so their cycles are collected as before. A freeze made by someone else
(`gc.get_freeze_count()` > 0) is left as it is. (Collecting generation 0 less often
was tried too: less time inside the collector, but no faster replay.)
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def old_objects_frozen():
    """Run the body with what exists frozen (unless the collector is off or someone
    froze objects already); thawed afterwards, also on an exception."""
    freeze = gc.isenabled() and gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    try:
        yield
    finally:
        if freeze:
            gc.unfreeze()
