"""Engines left to the cycle collector are collected once a process has grown
(`labkit.memory`): by the rule itself, and by every new engine."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from labkit import memory
from labkit.engine import Engine
from labkit.experiments.plan import evaluate
from tests.support import small_agentx


class Node:
    """Half of a reference cycle holding memory."""

    def __init__(self, payload=None) -> None:
        self.payload = payload
        self.other = None


def dropped_cycle(mb: int) -> weakref.ref:
    """A two-object cycle holding `mb` MB written through, no longer named."""
    a, b = Node(np.ones(mb * 2**20 // 8)), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture
def collector_off():
    gc.collect()
    gc.disable()
    yield
    gc.enable()


@pytest.fixture
def resident(monkeypatch):
    """The process's resident MB as the test sets it (a worker's allocator may reuse
    memory it holds, so real growth cannot be counted on), a fresh mark, restored after."""
    now = [1000.0]
    monkeypatch.setattr(memory, "resident_mb", lambda: now[0])
    monkeypatch.setattr(memory, "_after_last_mb", [])
    return now


def test_a_grown_process_collects_and_a_steady_one_does_not(collector_off, resident):
    assert not memory.collect_if_grown(64)  # (the first look sets the mark: 1,000 MB)
    cycle = dropped_cycle(1)
    resident[0] = 1060.0
    assert not memory.collect_if_grown(64) and cycle() is not None
    resident[0] = 1070.0
    assert memory.collect_if_grown(64) and cycle() is None
    resident[0] = 1100.0  # the mark is now what was resident after that collection
    assert not memory.collect_if_grown(64)


def test_a_real_dropped_cycle_is_freed_by_a_collection(collector_off):
    cycle = dropped_cycle(16)
    assert memory.collect_if_grown(-1e9) and cycle() is None  # (a mark always passed)


def engines_alive() -> int:
    return sum(type(o) is Engine for o in gc.get_objects())  # (isinstance reads __class__)


@pytest.mark.parametrize("grown_mb,most", [(100, 1), (1 << 20, 5)])
def test_a_new_engine_collects_the_dropped_ones_once_grown(collector_off, resident,
                                                           monkeypatch, grown_mb, most):
    """Plan points one after another, as a plan worker runs them, each growing the
    process 200 MB (the collector off): with a mark of 100 MB each new engine collects
    those dropped before it, so only the last point's is left; with a mark never
    reached all five stay."""
    monkeypatch.setattr(memory, "GROWN_MB", grown_mb)
    trace = small_agentx(4, seed=3)
    before = engines_alive()
    for layout in ("tp1", "dp2", "tp1", "dp2", "tp2"):
        resident[0] += 200.0
        row = evaluate({"layout": layout, "gpus": 2, "concurrency": 4}, trace,
                       "llama-3.1-8b", "h200", 5.0, 1.0, None)
        assert row["status"] == "ok"
    assert engines_alive() - before == most
