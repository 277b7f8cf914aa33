"""pytest configuration: fixtures shared by every test folder, and the workers' memory.

Engines sit in reference cycles, so one a test drops is freed by Python's cycle
collector, which runs by object counts: a worker that makes compute engines test after
test (each holding its paged KV caches, hundreds of MB) grew to 18 GB and was killed.
After any test that leaves the worker `COLLECT_GROWTH_MB` more resident than after the
last collection, the cycles are collected (`Engine.close()` is what code of one's own
should use).

`LABKIT_TEST_MEMORY_LOG=FILE` appends one line per test to FILE: the xdist worker, the
test, its seconds, the worker's resident MB after it (and after a collection, if one
ran, with the collection's seconds) and its peak so far.
"""

import gc
import os
import resource
import time

import pytest

from support import MOONCAKE

COLLECT_GROWTH_MB = 1024
_collected_at_mb = [0.0]  # resident MB after the last collection (or at the start)
MEMORY_LOG = os.environ.get("LABKIT_TEST_MEMORY_LOG")


@pytest.fixture
def mooncake_path():
    if not MOONCAKE.exists():
        pytest.skip(f"reference trace not found at {MOONCAKE} (../shared/data is absent)")
    return MOONCAKE


def _resident_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = time.perf_counter()
    yield
    after = _resident_mb()
    if not _collected_at_mb[0]:
        _collected_at_mb[0] = after
    collected = after > _collected_at_mb[0] + COLLECT_GROWTH_MB
    if collected:
        began = time.perf_counter()
        gc.collect()
        _collected_at_mb[0] = _resident_mb()
        collect_s = time.perf_counter() - began
    if MEMORY_LOG:
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        now = f"{after:.0f}->{_collected_at_mb[0]:.0f} in {collect_s:.2f} s" if collected \
            else f"{after:.0f}"
        with open(MEMORY_LOG, "a") as log:
            log.write(f"{worker}\t{item.nodeid}\t{time.perf_counter() - start:.1f}\t"
                      f"{now}\t{peak_mb:.0f}\n")
