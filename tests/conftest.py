"""pytest configuration: fixtures shared by every test folder.

`LABKIT_TEST_MEMORY_LOG=FILE` appends one line per test to FILE: the xdist worker, the
test, its seconds, the worker's resident memory after it and the worker's peak so far
(MB). A worker that swells shows which test (or which file's order) grew it.
"""

import os
import resource
import time

import pytest

from support import MOONCAKE

MEMORY_LOG = os.environ.get("LABKIT_TEST_MEMORY_LOG")


@pytest.fixture
def mooncake_path():
    if not MOONCAKE.exists():
        pytest.skip(f"reference trace not found at {MOONCAKE} (../shared/data is absent)")
    return MOONCAKE


def _resident_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


if MEMORY_LOG:

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        start = time.perf_counter()
        yield
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(MEMORY_LOG, "a") as log:
            log.write(f"{worker}\t{item.nodeid}\t{time.perf_counter() - start:.1f}\t"
                      f"{_resident_mb():.0f}\t{peak_mb:.0f}\n")
