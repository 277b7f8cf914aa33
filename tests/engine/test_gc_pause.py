"""A replay runs with what existed before it frozen (`gc_pause.py`), and thawed
afterwards."""

import gc
import weakref

import pytest

from support import small_agentx
from labkit import Engine
from labkit.engine.gc_pause import old_objects_frozen


class Node:
    def __init__(self):
        self.me = self  # a cycle: only the collector frees it


def garbage_cycle() -> weakref.ref:
    return weakref.ref(Node())


def test_old_objects_are_frozen_and_thawed_after():
    assert gc.get_freeze_count() == 0
    cycle = garbage_cycle()  # unreachable already, not collected yet
    with old_objects_frozen():
        assert gc.get_freeze_count() > 0
        gc.collect()
        assert cycle() is not None  # frozen: out of the collector's sight
        young = garbage_cycle()
        gc.collect()
        assert young() is None  # what the body makes is collected as usual
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert cycle() is None  # back in the oldest generation: collected again


def test_thawed_after_an_exception():
    with pytest.raises(KeyError):
        with old_objects_frozen():
            raise KeyError("boom")
    assert gc.get_freeze_count() == 0


def test_a_freeze_made_by_someone_else_is_left_alone():
    cycle = garbage_cycle()
    gc.freeze()  # someone's own freeze, made before ours
    try:
        with old_objects_frozen():
            assert gc.get_freeze_count() > 0
        gc.collect()
        assert cycle() is not None  # still frozen: not thawed by us
    finally:
        gc.unfreeze()
    gc.collect()
    assert cycle() is None


def test_a_replay_freezes_what_was_there_and_thaws_it(monkeypatch):
    seen = []
    real_step = Engine.step

    def step(self):
        seen.append(gc.get_freeze_count() > 0)
        return real_step(self)

    monkeypatch.setattr(Engine, "step", step)
    engine = Engine("tiny-llama", "dp2", "h200", block_size=16)
    engine.replay(small_agentx(4), concurrency=2, duration_s=20.0)
    assert seen and all(seen)
    assert gc.get_freeze_count() == 0
