"""Closing an engine frees its tensors at once.

An engine sits in reference cycles (its parts subscribe to its events and point back
at it), so dropping the last name of it leaves its paged KV caches to Python's cycle
collector, which runs by object counts and may not come for gigabytes: tests making
compute engines one after another grew a worker to 18 GB and had it killed.
`Engine.close()` (or `with Engine(...)`) lets the ranks go now; these tests hold the
collector off to show that it is the close that frees them.
"""

from __future__ import annotations

import gc
import weakref

import pytest
from compute_cases import FixedStepCost, compute_engine, shared_prefix_prompts, submit_prompts

from labkit.engine import Engine
from labkit.engine.disagg import PDEngine
from labkit.specs import get_model


@pytest.fixture
def no_collector():
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def kv_tensors(engine) -> list:
    return [weakref.ref(t) for rank in engine.data_plane.ranks
            for named in rank.kv.layers.values() for t in named.values()]


def small_run(engine) -> None:
    submit_prompts(engine, shared_prefix_prompts(get_model("tiny-llama").vocab_size),
                   max_tokens=4)
    while engine.step():
        pass


def test_close_frees_the_paged_kv_while_the_engine_is_still_referenced(no_collector):
    engine = compute_engine("tiny-llama", "tp2")
    small_run(engine)
    refs = kv_tensors(engine)
    assert len(refs) == 2 * 2 * 2  # ranks x layers x (k, v)
    del engine.data_plane.logits[:]  # (recorded logits are not the caches)
    assert all(r() is not None for r in refs)
    engine.close()
    assert all(r() is None for r in refs)
    engine.close()  # twice is fine
    assert engine.result().requests["output_tokens"].sum() == 3 * 4  # results stay


def test_without_close_the_kv_waits_for_the_cycle_collector(no_collector):
    """(What the close is for: an unreferenced engine keeps its caches until collected.)"""
    engine = compute_engine("tiny-llama", "tp2")
    small_run(engine)
    refs = kv_tensors(engine)
    del engine
    assert all(r() is not None for r in refs)
    gc.collect()
    assert all(r() is None for r in refs)


def test_with_block_closes_and_a_closed_engine_refuses_to_step(no_collector):
    with Engine("tiny-llama", "tp1", backend="compute", cost_model=FixedStepCost(),
                clock="predicted") as engine:
        small_run(engine)
        refs = kv_tensors(engine)
    assert engine.data_plane.closed and all(r() is None for r in refs)
    engine.submit_prompt([5, 6, 7, 8], 2, request_id="late")
    with pytest.raises(RuntimeError, match="closed"):
        while engine.step():
            pass


def test_a_pd_engine_closes_every_group(no_collector):
    with PDEngine("tiny-llama", "tp1", "tp1", backend="compute", cost_model=FixedStepCost(),
                  clock="predicted", num_decode=2) as engine:
        small_run(engine)
        refs = [r for e in engine.prefill + engine.decode for r in kv_tensors(e)]
    assert len(refs) == 3 * 2 * 2 and all(r() is None for r in refs)
