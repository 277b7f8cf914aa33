"""Engines left to the cycle collector are collected once a process has grown
(`labkit.memory`): by the rule itself, and by the loops that run engine after engine."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from labkit import memory
from labkit.engine import Engine
from labkit.experiments.plan import evaluate
from labkit.experiments.rate_matching import pd_profile
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


def test_a_grown_process_collects_and_a_steady_one_does_not(collector_off):
    memory.collect_if_grown(0)  # (the mark: now)
    small = dropped_cycle(1)
    assert not memory.collect_if_grown(64) and small() is not None
    big = dropped_cycle(128)
    assert memory.collect_if_grown(64)
    assert big() is None and small() is None
    assert not memory.collect_if_grown(64)  # the mark moved to after the collection


def engines_alive() -> int:
    return sum(type(o) is Engine for o in gc.get_objects())  # (isinstance reads __class__)


@pytest.mark.parametrize("run", ["plan point", "pd profile"])
def test_loops_of_engines_leave_none_behind_once_grown(collector_off, monkeypatch, run):
    """With the growth mark at 0 every point collects: no engine is left over, though
    the collector is off (without the call, each point's engine stays in its cycles)."""
    monkeypatch.setattr(memory, "GROWN_MB", 0)
    trace = small_agentx(4, seed=3)
    before = engines_alive()
    if run == "plan point":
        for layout in ("tp1", "dp2"):
            row = evaluate({"layout": layout, "gpus": 2, "concurrency": 4}, trace,
                           "llama-3.1-8b", "h200", 5.0, 1.0, None)
            assert row["status"] == "ok"
    else:
        pd_profile("llama-3.1-8b", trace, ["tp1"], ["tp1"], duration_s=5.0,
                   concurrency=(2, 4))
    assert engines_alive() == before
