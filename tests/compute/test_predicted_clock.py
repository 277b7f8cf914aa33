"""On the cost model's clock (`clock="predicted"`) a compute replay schedules exactly as
the simulated replay of the same cluster: the real tensors change the tokens, nothing
else. So the two tables must agree bit for bit — steps, calls, cache hits, hand-overs —
which checks the control plane's compute-only paths (real token keys, KV copies, state
exports) against the simulated ones it shares everything else with.

(Not compared: speculative decoding, whose accepted drafts are the real model's.)"""

from __future__ import annotations

import random

import pytest
from compute_cases import SHORT, FixedStepCost, agentic_trace

from labkit.engine.disagg import PDEngine
from labkit.engine.engine import Engine
from labkit.errors import ConfigError
from tests.fuzz_paths import check_case, random_compute_case


def replay_both(make) -> tuple:
    """The same trace (three sessions of the shorter agentic trace) replayed on the sim
    plane and on the compute plane (predicted)."""
    out = []
    for plane in (dict(backend="sim"), dict(backend="compute", clock="predicted")):
        engine = make(cost_model=FixedStepCost(), **plane)
        out.append(engine.replay(agentic_trace(3, **SHORT), concurrency=4, loop_trace=False,
                                 max_idle_s=1.0, start_part_way=False))
    return tuple(out)


def assert_same_schedule(sim, compute) -> None:
    assert sim.steps.equals(compute.steps)
    calls = compute.requests.drop(columns="output_token_ids")
    assert sim.requests.equals(calls)


@pytest.mark.parametrize("model, layout, knobs", [
    ("tiny-llama", "dp2", {}),  # a session's KV fetched from the other rank (copied)
    ("tiny-qwen3-moe", "dep2", {}),  # lockstep
    ("tiny-kimi-linear", "dp2", {}),  # state snapshots, fetched with the KV
    ("tiny-gpt-oss", "dp2", dict(max_num_batched_tokens=32)),  # windows (fetched), chunks
    # engine blocks smaller than the trace's: where a call's context ends inside a trace
    # block, the next call's id for it differs, yet the engine blocks hold the same
    # tokens (the sim keyed them apart: fewer hits, snapshots missed)
    ("tiny-kimi-linear", "tp1", dict(block_size=8, num_gpu_blocks_override=120)),
])
def test_a_compute_replay_on_the_predicted_clock_schedules_as_the_sim(model, layout, knobs):
    knobs = dict(dict(num_gpu_blocks_override=60), **knobs)
    sim, compute = replay_both(lambda **kw: Engine(model, layout, **knobs, **kw))
    assert_same_schedule(sim, compute)
    assert sim.summary["prefix_cache_hit_rate"] > 0.3  # (the keys are checked)
    if layout.startswith("dp"):
        assert sim.summary["kv_fetched_tokens"] > 100


def test_pd_hands_over_as_the_sim_does():
    """The prefill side's sampled token is dropped: it must not enter the call's token
    keys (it did: every later block's key shifted by a token, so the decode side never
    found the blocks holding output tokens and more KV crossed than the sim sends)."""
    sim, compute = replay_both(lambda **kw: PDEngine("tiny-llama", "pcp2", "tp2",
                                                     num_gpu_blocks_override=60, **kw))
    assert_same_schedule(sim, compute)
    sent = compute.requests["transferred_tokens"]
    assert (sent < compute.requests["input_tokens"] - 1).any()  # the decode side's hits


def test_pd_of_a_hybrid_model_without_prefix_caching():
    """No snapshots on either side: the hand-over carries the state after the prompt
    alone (asking for the one at its last block boundary, which only a side with
    snapshots keeps, failed the export)."""
    sim, compute = replay_both(lambda **kw: PDEngine(
        "tiny-kimi-linear", "tp1", "tp1", num_gpu_blocks_override=60,
        enable_prefix_caching=False, **kw))
    assert_same_schedule(sim, compute)


def test_pd_of_a_hybrid_model_needs_prefix_caching_alike_on_both_sides():
    with pytest.raises(ConfigError, match="enable_prefix_caching on both roles"):
        PDEngine("tiny-kimi-linear", "tp1", "tp1", backend="compute", clock="predicted",
                 cost_model=FixedStepCost(), prefill_knobs=dict(enable_prefix_caching=False))


@pytest.mark.parametrize("pd, seeds, least", [(False, range(5, 8), 3), (True, range(100, 104), 3)],
                         ids=["one engine", "P/D"])
def test_fixed_seeds_of_the_fuzzers_compute_mode_schedule_as_the_sim(pd, seeds, least):
    """A few seeds of `tests/fuzz_paths.py --against compute`: random tiny presets,
    layouts (DP, EP, PP, DCP, PCP), knobs (small pools, budgets, offload tiers, block
    sizes, caching or chunking off, routers) and the preset's own cost model or a fixed
    one — the tables and summary as the sim's, bit for bit."""
    compared = 0
    for seed in seeds:
        diff = check_case(random_compute_case(random.Random(seed), pd), "compute")
        if diff is not None:
            compared += 1
            assert not diff, (seed, diff)
    assert compared >= least
