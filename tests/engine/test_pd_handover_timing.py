"""When a P/D hand-over first decodes, worked out by hand from vLLM's rule.

vLLM's decode instance receives a hand-over from the proxy as a new request: under async
scheduling (the default) a busy engine schedules step N+1 while step N runs, so a
request that arrives during step N is first seen by step N+2's scheduler, which
allocates its blocks and puts it in WAITING_FOR_REMOTE_KVS; the worker starts the NIXL
read when that step runs. The worker reports the read done (`get_finished`) at the end
of the step during which it lands, and the scheduler reads that report after it has
already scheduled the next step: the call computes from the step after that. An idle
decode engine sees both at once (it polls with empty steps). The prefill blocks stay
held until the read is done. The read brings all of the prompt but its last token, which
the call's first decode step computes, sampling the call's first token (the proxy drops
the prefill side's).

Every step takes 10 ms (`FixedStepCost`), so the decode group's steps start at the
first call's landing plus multiples of 10 ms."""

import pytest

from support import FixedStepCost
from labkit.engine.disagg import PDEngine, transfer_seconds
from labkit.engine.request import Request

STEP = FixedStepCost.min_step_s


@pytest.mark.parametrize("ff", [True, False])
def test_a_hand_over_into_a_busy_decode_group_is_seen_a_step_late_twice(ff):
    engine = PDEngine("llama-3.1-8b", "tp1", "tp1", cost_model=FixedStepCost(),
                      sim_fast_forward=ff)
    p, d = engine.prefill[0], engine.decode[0]
    # A: prefilled in [0, 10 ms]; the idle decode group admits it at once and its KV
    # (999 tokens: the last is computed there) lands at land_a; its decode steps then
    # start at land_a + k x 10 ms
    a = Request("a", "sa", 1000, 100, 0.0)
    land_a = STEP + transfer_seconds(p, d, 999)
    # B arrives while A decodes; the idle prefill group hands it over 10 ms later, at
    # land_a + 34.5 ms: during A's decode step 3 (it starts at land_a + 30 ms)
    b = Request("b", "sb", 200, 10, 0.0)
    arrive_b = land_a + 0.0245
    handed = arrive_b + STEP
    engine.submit(a, at=0.0)
    engine.submit(b, at=arrive_b)

    def step_start(k):
        return land_a + k * STEP

    # step 4 was scheduled during step 3, before B came: step 5 admits it, at its start
    # (the old rule, judging B by its call's arrival, admitted it in step 4)
    seconds = transfer_seconds(p, d, 199)
    assert seconds < STEP  # it lands during step 5
    engine.run_until(step_start(5) + seconds / 2)
    transfer = engine.transfers[1]
    assert transfer["request_id"] == "b"
    assert transfer["start_s"] == pytest.approx(step_start(5), abs=1e-12)
    land_b = step_start(5) + seconds
    # B's prompt KV is still held on the prefill side while it crosses
    assert "b" in p.schedulers[0].kv.tables
    engine.run_until(land_b + 1e-9)
    assert "b" not in p.schedulers[0].kv.tables
    # step 6 was scheduled during step 5, before the landing was reported: B computes
    # its last prompt token in step 7, and its first token comes at that step's end
    engine.run_until(1.5)
    assert b.finished and a.finished
    assert b.first_token_s == pytest.approx(step_start(7) + STEP, abs=1e-9)
    assert list(b.itl) == pytest.approx([STEP] * 9, abs=1e-9)
    assert b.finish_s == pytest.approx(step_start(7) + 10 * STEP, abs=1e-9)
    assert a.first_token_s == pytest.approx(land_a + STEP, abs=1e-9)
    # and the call keeps its own arrival for TTFT / E2EL
    assert b.arrival_s == arrive_b and b.enqueued_s == handed


def test_an_idle_decode_group_sees_a_hand_over_and_its_landing_at_once():
    """One call: nothing else runs on the decode side, so there is no lag at all."""
    engine = PDEngine("llama-3.1-8b", "tp1", "tp1", cost_model=FixedStepCost())
    p, d = engine.prefill[0], engine.decode[0]
    a = Request("a", "sa", 1000, 4, 0.0)
    engine.submit(a, at=0.0)
    engine.run_until(1.0)
    assert engine.transfers[0]["start_s"] == STEP
    assert engine.transfers[0]["tokens"] == 999
    land = STEP + transfer_seconds(p, d, 999)
    assert a.first_token_s == pytest.approx(land + STEP, abs=1e-12)
    assert list(a.itl) == pytest.approx([STEP] * 3, abs=1e-12)
    assert a.finish_s == pytest.approx(land + 4 * STEP, abs=1e-9)


def test_without_async_scheduling_the_next_step_sees_both():
    """The same two calls, async scheduling off: B is admitted by the first step that
    starts after it came (step 4) and decodes from the first that starts after its KV
    landed (step 5), where it computes its last prompt token and samples its first."""
    engine = PDEngine("llama-3.1-8b", "tp1", "tp1", cost_model=FixedStepCost(),
                      async_scheduling=False)
    p, d = engine.prefill[0], engine.decode[0]
    land_a = STEP + transfer_seconds(p, d, 999)
    a, b = Request("a", "sa", 1000, 100, 0.0), Request("b", "sb", 200, 10, 0.0)
    engine.submit(a, at=0.0)
    engine.submit(b, at=land_a + 0.0245)
    engine.run_until(1.5)
    assert engine.transfers[1]["start_s"] == pytest.approx(land_a + 4 * STEP, abs=1e-12)
    assert land_a + 4 * STEP + transfer_seconds(p, d, 199) < land_a + 5 * STEP
    assert b.first_token_s == pytest.approx(land_a + 6 * STEP, abs=1e-9)


def test_a_one_token_call_still_gets_its_token_from_the_decode_side():
    """vLLM's proxy sends every call on to decode, even one that wants a single token:
    the prefill side's token is dropped, so the call's only token comes one decode step
    after its KV lands."""
    engine = PDEngine("llama-3.1-8b", "tp1", "tp1", cost_model=FixedStepCost())
    p, d = engine.prefill[0], engine.decode[0]
    a = Request("a", "sa", 500, 1, 0.0)
    engine.submit(a, at=0.0)
    engine.run_until(1.0)
    assert a.finished and a.num_output_tokens == 1 and len(a.itl) == 0
    land = STEP + transfer_seconds(p, d, 499)
    assert a.first_token_s == pytest.approx(land + STEP, abs=1e-12)
    assert a.finish_s == a.first_token_s
    assert engine.transfers[0]["tokens"] == 499
