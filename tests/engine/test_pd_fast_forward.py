"""Fast-forward on prefill/decode disaggregation must change nothing either: a P/D
replay step by step and fast-forwarded gives identical tables, bit for bit.

What makes P/D different from one engine (`test_fast_forward.py`): calls arrive at a
decode group mid-run, handed over by a prefill group, and wait there while their KV
crosses the network; the decode scheduler sees a hand-over at once (it keeps its call's
arrival, `disagg.py`), and a call whose KV has landed joins the decode steps already
decoding. Slow hand-overs keep calls on the wire over many decode steps."""

import dataclasses

import pandas as pd
import pytest

from support import small_agentx
from labkit.engine.disagg import PDEngine
from labkit.specs import get_hardware

SLOW_NIC = dataclasses.replace(get_hardware("h200"), internode_bandwidth=2e9)  # 2 GB/s

CONFIGS = {
    "1 x tp2 -> 2 x tp1": dict(prefill_layout="tp2", decode_layout="tp1", num_prefill=1,
                               num_decode=2),
    "2 x tp1 -> 1 x tp2": dict(prefill_layout="tp1", decode_layout="tp2", num_prefill=2,
                               num_decode=1),
    "1 x tp2 -> 2 x tp1, no async scheduling": dict(
        prefill_layout="tp2", decode_layout="tp1", num_prefill=1, num_decode=2,
        async_scheduling=False),
    "slow hand-overs, spec decode": dict(
        prefill_layout="tp2", decode_layout="tp1", num_prefill=1, num_decode=2,
        hardware=SLOW_NIC, decode_knobs=dict(num_speculative_tokens=2,
                                             acceptance_length=2.5)),
}


def replay(ff: bool, cfg: dict):
    cfg = {"hardware": "h200", **cfg}
    engine = PDEngine("llama-3.1-8b", sim_fast_forward=ff, **cfg)
    result = engine.replay(small_agentx(12, seed=1), concurrency=16, duration_s=3,
                           max_idle_s=0.0, start_part_way=False, warmup_s=0.5)
    return engine, result


@pytest.mark.parametrize("name", list(CONFIGS))
def test_pd_fast_forward_is_exact(name):
    fast_engine, fast = replay(True, CONFIGS[name])
    slow_engine, slow = replay(False, CONFIGS[name])
    assert len(slow_engine.transfers) > 50  # many hand-overs into running decode groups
    pd.testing.assert_frame_equal(fast.requests, slow.requests, check_exact=True)
    pd.testing.assert_frame_equal(fast.steps, slow.steps, check_exact=True)
    assert fast_engine.transfers == slow_engine.transfers
    drop = {"wall_s", "sim_speed"}  # wall-clock
    assert {k: repr(v) for k, v in fast.summary.items() if k not in drop} == \
        {k: repr(v) for k, v in slow.summary.items() if k not in drop}  # (nan == nan)
    # and it did fast-forward: fewer committed plans on the decode side (hand-overs cut
    # runs often here)
    chunks = [sum(e.step_recorder.num_events for e in engine.decode)
              for engine in (fast_engine, slow_engine)]
    assert chunks[0] < 0.75 * chunks[1]


def test_slow_hand_overs_stay_on_the_wire_for_many_decode_steps():
    """The slow-NIC case does what it is there for: many hand-overs span ten decode
    steps or more, so runs are planned while calls wait for their KV."""
    engine, result = replay(True, CONFIGS["slow hand-overs, spec decode"])
    decode_step = result.steps[result.steps.role == "decode"].duration_s.median()
    moves = pd.DataFrame(engine.transfers)
    assert (moves.seconds > 10 * decode_step).mean() > 0.25


def test_hand_overs_landing_together_free_the_prefill_side_in_one_order_either_way():
    """A looped trace's copies of a call, prefilled in one step and handed to two decode
    groups, land at the same time; their prefill blocks are freed in the order of the
    calls' `seq`, which must not depend on the path (the engine's step timers once
    shared its count: step by step, a group numbered its arrivals past hundreds of
    timers, fast-forwarded past a few). The order of those frees decides which copy's
    prefix the prefill rank evicts first."""
    trace = small_agentx(3, seed=780656)
    results, seqs = [], []
    for ff in (False, True):
        engine = PDEngine("tiny-llama", prefill_layout="dp2", decode_layout="dp4",
                          num_prefill=1, num_decode=2, hardware="h100",
                          max_num_batched_tokens=16384, num_gpu_blocks_override=1500,
                          decode_knobs=dict(num_speculative_tokens=2, acceptance_length=2.5),
                          sim_fast_forward=ff)
        results.append(engine.replay(trace, concurrency=16, duration_s=10, max_idle_s=2.0,
                                     start_part_way=False))
        seqs.append({rid: r.seq for rid, r in engine.requests.items()})
    landing_together = len(engine.transfers) - len(
        {round(t["start_s"] + t["seconds"], 12) for t in engine.transfers})
    assert landing_together > 10
    assert seqs[0] == seqs[1]
    step, fast = results
    pd.testing.assert_frame_equal(fast.requests, step.requests, check_exact=True)
    pd.testing.assert_frame_equal(fast.steps, step.steps, check_exact=True)
