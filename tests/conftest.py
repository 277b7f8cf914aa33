"""pytest configuration: fixtures shared by every test folder, and the workers' memory.

Engines sit in reference cycles, freed by the cycle collector, which runs by object
counts: a worker making compute engines test after test (each holding its paged KV
caches, hundreds of MB) grew to 18 GB and was killed. After any test that leaves the
worker `COLLECT_GROWTH_MB` more resident than after the last collection, the cycles are
collected (`labkit.memory`; `Engine.close()` is what code of one's own should use).

`LABKIT_TEST_MEMORY_LOG=FILE` appends one line per test to FILE: the xdist worker, the
test, its seconds, the worker's resident MB after it (and after a collection, if one
ran, with the collection's seconds) and its peak so far.

The longest files run first (`LONG_FILES`): `make test` hands whole files to its two
workers in collection order (`--dist loadfile --no-loadscope-reorder`), and a long file
handed out last would run alone while the other worker sits idle.
"""

import os
import resource
import time

import pytest

from labkit.memory import collect_if_grown, resident_mb
from support import MOONCAKE

COLLECT_GROWTH_MB = 1024
MEMORY_LOG = os.environ.get("LABKIT_TEST_MEMORY_LOG")
LONG_FILES = (  # two minutes and more of a worker each (`pytest --durations`), longest first
    "tests/compute/test_runner_replay.py", "tests/compute/test_pd_compute.py",
    "tests/compute/test_mp_executor.py", "tests/test_readme.py",
    "tests/browser/test_tutorial_pictures.py", "tests/engine/test_fuzz_paths.py",
    "tests/compute/test_predicted_clock.py", "tests/kernels/test_kernel_aot.py",
)


def pytest_collection_modifyitems(config, items):
    """The long files first, in `LONG_FILES`' order; the rest as collected."""
    first = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))


@pytest.fixture
def mooncake_path():
    if not MOONCAKE.exists():
        pytest.skip(f"reference trace not found at {MOONCAKE} (../shared/data is absent)")
    return MOONCAKE


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = time.perf_counter()
    yield
    after = resident_mb()
    began = time.perf_counter()
    collected = collect_if_grown(COLLECT_GROWTH_MB)
    if MEMORY_LOG:
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        now = f"{after:.0f}->{resident_mb():.0f} in {time.perf_counter() - began:.2f} s" \
            if collected else f"{after:.0f}"
        with open(MEMORY_LOG, "a") as log:
            log.write(f"{worker}\t{item.nodeid}\t{began - start:.1f}\t{now}\t{peak_mb:.0f}\n")
