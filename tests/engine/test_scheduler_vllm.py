"""Scheduler rules as vLLM v1 has them, each on a small schedule worked out by hand.

Written from the intent of vLLM's own tests (tests/v1/core/test_scheduler.py and
test_prefix_caching.py): a scheduler over a tiny KV pool, requests added by hand,
`schedule()` then `update()` as the engine core would call them, and the expected
batches derived on paper from the rule — never read back from the implementation.
"""

import numpy as np
import pytest

from labkit import Engine
from labkit.engine.events import EventBus
from labkit.engine.kv import KVManager, TraceBlockKeys
from labkit.engine.request import Request, Status
from labkit.engine.scheduler import Scheduler
from labkit.specs import EngineConfig

BS = 16


def scheduler(num_blocks: int = 64, **knobs) -> Scheduler:
    config = EngineConfig(**knobs)
    return Scheduler(config, KVManager(num_blocks, BS, config.enable_prefix_caching), EventBus())


def request(name: str, prompt: int, output: int = 8, ids=None, priority: int = 0,
            arrival: float = 0.0) -> Request:
    """A request whose prompt blocks carry the trace ids `ids` (distinct by default)."""
    if ids is None:
        ids = np.arange(1000 * (1 + int(name[1:])), 1000 * (1 + int(name[1:])) + 64)
    return Request(name, name, prompt, output, arrival, priority=priority,
                   keys=TraceBlockKeys(np.asarray(ids, dtype=np.int64), BS, BS))


def step(s: Scheduler, accepted: int = 1, throttle: bool = False) -> dict:
    """Plan and execute one step; returns {request id: tokens scheduled}."""
    batch = s.schedule(0, throttle)
    s.update(batch, accepted, t_end=s.now + 1.0)
    s.now += 1.0
    return dict(zip((r.request_id for r in batch.requests), batch.num_new_tokens))


# --------------------------------------------------------------- speculative decoding
def test_a_decode_cut_by_the_budget_gains_no_more_than_it_was_scheduled():
    """1 draft, acceptance 2.0, budget 3, two 1-token prompts (issue 12 item 3).

    Step 0 prefills both (1 + 1 tokens) and samples their first tokens. From then on
    r0 takes its full verify step (1 + 1 = 2 tokens) and r1 the 1 token left: r1
    verifies no draft, so it gains 1 token a step, not 2. Once r0 is done (7 tokens:
    1 + 2 + 2 + 2), r1 gets 2 again and finishes with 1 (its last token)."""
    s = scheduler(num_speculative_tokens=1, acceptance_length=2.0, max_num_batched_tokens=3)
    r0, r1 = request("r0", 1, output=7), request("r1", 1, output=7)
    s.add_request(r0)
    s.add_request(r1)
    expected = [({"r0": 1, "r1": 1}, (1, 1)), ({"r0": 2, "r1": 1}, (3, 2)),
                ({"r0": 2, "r1": 1}, (5, 3)), ({"r0": 2, "r1": 1}, (7, 4)),
                ({"r1": 2}, (7, 6)), ({"r1": 2}, (7, 7))]
    for scheduled, outputs in expected:
        assert step(s, accepted=2) == scheduled
        assert (r0.num_output_tokens, r1.num_output_tokens) == outputs
        for r in (r0, r1):  # KV only for tokens some step computed: prompt + outputs - 1
            if not r.finished:
                assert r.num_computed_tokens == r.num_tokens - 1
    assert r0.finished and r1.finished


def test_the_fidelity_case_three_drafts_budget_ten():
    """3 drafts, acceptance 4.0, budget 10, three 3-token prompts (issue 13): after the
    prefill step r0 and r1 verify 1 + 3 tokens and r2 the 2 the budget leaves; r2
    gains 2 tokens, not 4."""
    s = scheduler(num_speculative_tokens=3, acceptance_length=4.0, max_num_batched_tokens=10)
    reqs = [request(f"r{i}", 3, output=20) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    assert step(s, accepted=4) == {"r0": 3, "r1": 3, "r2": 3}
    assert step(s, accepted=4) == {"r0": 4, "r1": 4, "r2": 2}
    assert [r.num_output_tokens for r in reqs] == [5, 5, 3]


@pytest.mark.parametrize("fast_forward", [False, True])
def test_engine_never_credits_a_cut_decode_with_unscheduled_tokens(fast_forward):
    """The same rule through the engine (instance, finishing checks, fast-forward):
    every decode entry gains at most its scheduled tokens, and each request's output
    count equals what its steps gained."""
    engine = Engine("tiny-llama", "tp1", "h100", num_gpu_blocks_override=64, block_size=BS,
                    num_speculative_tokens=3, acceptance_length=4.0,
                    max_num_batched_tokens=10, sim_fast_forward=fast_forward)
    gains = []
    s = engine.schedulers[0]
    original = s.update

    def update(batch, accepted, t_end, tokens=None):
        before = [r.num_output_tokens for r in batch.requests]
        finished = original(batch, accepted, t_end, tokens)
        for r, n, d, b in zip(batch.requests, batch.num_new_tokens, batch.is_decode, before):
            gains.append((n, d, r.num_output_tokens - b))
        return finished
    s.update = update
    reqs = [request(f"r{i}", 3, output=30) for i in range(3)]
    for r in reqs:
        engine.submit(r, at=0.0)
    engine.run_until()
    assert all(r.finished and r.num_output_tokens == 30 for r in reqs)
    assert any(d and n < 4 for n, d, _ in gains)  # the budget did cut decodes
    assert all(g <= n for n, d, g in gains if d)


# ------------------------------------------------------------------ same-step hits
def test_identical_prompts_admitted_in_one_step_share_their_blocks():
    """Two identical 33-token prompts in one step (vLLM registers full blocks when it
    allocates them): the first computes 33 tokens, the second hits its 2 full blocks
    (at most 32 tokens: one must be recomputed for logits) and computes 1."""
    s = scheduler()
    ids = np.arange(7, 7 + 8)
    a, b = request("r0", 33, ids=ids), request("r1", 33, ids=ids)
    s.add_request(a)
    s.add_request(b)
    assert step(s) == {"r0": 33, "r1": 1}
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 32)
    table_a, table_b = s.kv.table("r0"), s.kv.table("r1")
    assert list(table_b[:2]) == list(table_a[:2]) and table_b[2] != table_a[2]


def test_a_chunk_shares_only_the_blocks_its_step_fills():
    """long_prefill_token_threshold 32: r0 (80 tokens) prefills 32 this step, filling 2
    blocks; an identical r1 in the same step hits those 2 (32 tokens) and computes its
    own next 32, not r0's future ones."""
    s = scheduler(long_prefill_token_threshold=32)
    ids = np.arange(50, 60)
    a, b = request("r0", 80, ids=ids), request("r1", 80, ids=ids)
    s.add_request(a)
    s.add_request(b)
    assert step(s) == {"r0": 32, "r1": 32}
    assert b.num_cached_tokens == 32 and b.num_computed_tokens == 64


def test_without_chunked_prefill_the_threshold_still_chunks_a_prompt():
    """enable_chunked_prefill off, long_prefill_token_threshold 32, budget 40: vLLM caps
    a prompt by the threshold first and only then refuses to take less than that share
    of the budget. r0 (80 tokens) prefills 32, 32, 16 (running: the threshold, then the
    rest); r1 (48 tokens, waiting) takes its 32 only in a step with 32 left: not in
    steps 0 and 1 (8 left after r0's 32), nor 2 (24 left after r0's 16); in step 3,
    beside r0's first decode, then its last 16. (It waited forever before: a share
    below the whole prompt was refused.)"""
    s = scheduler(enable_chunked_prefill=False, long_prefill_token_threshold=32,
                  max_num_batched_tokens=40)
    r0, r1 = request("r0", 80), request("r1", 48)
    s.add_request(r0)
    s.add_request(r1)
    assert step(s) == {"r0": 32}
    assert step(s) == {"r0": 32}
    assert step(s) == {"r0": 16}
    assert step(s) == {"r0": 1, "r1": 32}
    assert step(s) == {"r0": 1, "r1": 16}


def test_without_chunked_prefill_a_prompt_waits_for_a_step_it_fits_whole():
    """No threshold, budget 64: r0 (40 tokens) prefills whole; r1 (40) would fit only
    in part of the 24 left, so it waits for the next step; the running r0 decodes."""
    s = scheduler(enable_chunked_prefill=False, max_num_batched_tokens=64)
    r0, r1 = request("r0", 40), request("r1", 40)
    s.add_request(r0)
    s.add_request(r1)
    assert step(s) == {"r0": 40}
    assert step(s) == {"r0": 1, "r1": 40}


def test_another_rank_sees_only_computed_blocks():
    """Blocks registered by a step not yet run are this rank's to share (the step
    writes them before anyone reads them) but not KV another rank could copy."""
    kv = KVManager(16, BS)
    ids = np.arange(100, 110)
    a, b = request("r0", 64, ids=ids), request("r1", 64, ids=ids)
    assert kv.allocate(a, 48)
    kv.register_blocks(a, 48)
    assert kv.lookup(b).num_tokens == 48
    assert kv.lookup(b, computed_only=True).num_tokens == 0
    a.num_computed_tokens = 48  # the step ran
    kv.cache_full_blocks(a)
    assert kv.lookup(b, computed_only=True).num_tokens == 48


def test_write_through_waits_for_the_step_that_computes_the_blocks():
    stored = []
    kv = KVManager(16, BS, on_cached=lambda rank, blocks, keys, t, starting:
                   stored.append(blocks.tolist()))
    a = request("r0", 64)
    assert kv.allocate(a, 40)
    kv.register_blocks(a, 40)
    assert stored == []  # hittable already, but its KV does not exist yet
    a.num_computed_tokens = 40
    kv.cache_full_blocks(a)
    assert stored == [kv.table("r0")[:2].tolist()]


# --------------------------------------------------------------- priority preemption
def test_a_request_that_preempts_itself_ends_the_running_pass():
    """Priority policy, a pool of 6 blocks. r0 (20-token prompt, priority 0) and r1
    (31 tokens, priority 5) run first; r2 (20 tokens, priority 0) joins a step later:
    2 + 2 + 2 blocks, the pool is full. In the third step r0 decodes within its
    blocks, r1 crosses into a third block, finds none, and the lowest-priority running
    request is r1 itself: it is preempted and the pass ends — r2, which needs no new
    block, does not run in that step either (vLLM breaks out of the running loop)."""
    s = scheduler(num_blocks=6, scheduling_policy="priority")
    r0, r1 = request("r0", 20, priority=0), request("r1", 31, priority=5)
    s.add_request(r0)
    s.add_request(r1)
    assert step(s) == {"r0": 20, "r1": 31}
    r2 = request("r2", 20, priority=0, arrival=1.0)
    s.add_request(r2)
    assert step(s) == {"r0": 1, "r1": 1, "r2": 20}
    assert s.kv.pool.num_free == 0
    assert step(s) == {"r0": 1}
    assert r1.status is Status.PREEMPTED and r2.status is Status.RUNNING


# ------------------------------------------------------- prefill_schedule_interval
def decoding_scheduler(**knobs):
    """A scheduler with one request ("run0", 8 tokens) already decoding."""
    s = scheduler(max_num_seqs=16, **knobs)
    run0 = request("r0", 8, output=50)
    s.add_request(run0)
    step(s)
    assert run0.is_decoding
    return s


@pytest.mark.parametrize("has_running", [True, False])
def test_a_throttled_step_defers_a_new_prefill_only_behind_a_decode(has_running):
    s = decoding_scheduler() if has_running else scheduler()
    new = request("r9", 8)
    s.add_request(new)
    if has_running:
        assert step(s, throttle=True) == {"r0": 1}  # the decode runs, the prefill waits
        assert new.status is Status.WAITING
    assert "r9" in step(s, throttle=not has_running)  # nothing to protect, or on the beat


def test_a_throttled_step_defers_a_running_prefill_chunk():
    """Budget 50: r1 (80 tokens) gets 49 tokens beside r0's decode, then waits out a
    throttled step while r0 decodes, then resumes with its remaining 31."""
    s = decoding_scheduler(max_num_batched_tokens=50)
    s.add_request(request("r1", 80))
    assert step(s) == {"r0": 1, "r1": 49}
    assert step(s, throttle=True) == {"r0": 1}
    assert step(s) == {"r0": 1, "r1": 31}


def test_a_saturated_rank_is_not_throttled():
    """Capacity-bound guard: budget 200, two 200-token prompts. The admitting step
    fills the budget with `a` and leaves `b` waiting; so the next, throttled step
    admits `b` anyway (beside a's decode) instead of letting the backlog grow. Had
    the admitting step drained the queue, a throttled step would defer."""
    s = scheduler(max_num_seqs=16, max_num_batched_tokens=200)
    a, b = request("r0", 200), request("r1", 200)
    s.add_request(a)
    s.add_request(b)
    assert step(s) == {"r0": 200}
    assert s.prefill_capacity_bound
    assert step(s, throttle=True) == {"r0": 1, "r1": 199}
    # b's last token is one token of work: it runs in the throttled step that follows
    assert step(s, throttle=True) == {"r0": 1, "r1": 1}
    assert not s.prefill_capacity_bound  # the step that admitted b drained the queue
    c = request("r2", 40)
    s.add_request(c)
    assert step(s, throttle=True) == {"r0": 1, "r1": 1}


def test_an_arrival_the_step_could_not_see_is_not_saturation():
    """Async scheduling: a request that arrived after the admitting step was scheduled
    was not in the queue that step saw, so it did not leave the rank saturated: the
    next, throttled step defers it behind the decode. (Counting it made every arrival
    lift the throttle, so prefill_schedule_interval=2 changed nothing at all.)"""
    s = decoding_scheduler()
    late = request("r7", 40, arrival=s.now + 0.5)
    s.add_request(late)
    s.visible_until = s.now  # this step was scheduled before `late` arrived
    assert step(s) == {"r0": 1}
    assert not s.prefill_capacity_bound
    s.visible_until = s.now
    assert step(s, throttle=True) == {"r0": 1}  # off the beat: the prefill waits
    assert step(s) == {"r0": 1, "r7": 40}  # on the beat it is admitted


def test_prefix_hits_and_transfers_are_not_prefill_work():
    """A waiting request whose prompt is cached but for its last token computes one
    token: a throttled step admits it."""
    s = decoding_scheduler()
    ids = np.arange(300, 310)
    first = request("r5", 33, ids=ids)
    s.add_request(first)
    step(s)  # on the beat: first prefills and caches 2 blocks
    again = request("r6", 33, ids=ids)
    s.add_request(again)
    assert step(s, throttle=True) == {"r0": 1, "r5": 1, "r6": 1}


@pytest.mark.parametrize("model,layout", [("tiny-qwen3-moe", "dep4"), ("tiny-llama", "tp1")])
def test_interval_throttles_on_the_beat_of_the_shared_step_index(model, layout):
    """Through the engine (a dep4 lockstep instance, a plain tp1 one): on an off-beat
    step a rank that had a request able to decode, and was not saturated, computes no
    prefill work; on-beat steps do admit; the throttle really did defer."""
    engine = Engine(model, layout, "h100", num_gpu_blocks_override=300, block_size=BS,
                    prefill_schedule_interval=4, router="round_robin", sim_fast_forward=False)
    seen = {"deferred": 0, "admitted_on_beat": 0}
    for s in engine.schedulers:
        s.schedule = _watch_throttle(s, s.schedule, seen)
    reqs = [request(f"r{i}", 40 + 37 * i % 300, output=20 + 7 * i % 60, arrival=0.003 * i)
            for i in range(24)]
    for r in reqs:
        engine.submit(r, at=r.arrival_s)
    engine.run_until()
    assert all(r.finished for r in reqs)
    assert seen["deferred"] > 5 and seen["admitted_on_beat"] > 3, seen


def _watch_throttle(s, original, seen):
    def schedule(step_index, *args):
        can_decode = any(r.num_pending_tokens == 1 and not r.kv_ready_s for r in s.running)
        saturated = s.prefill_capacity_bound
        batch = original(step_index, *args)
        prefill = [n for n, d in zip(batch.num_new_tokens, batch.is_decode) if not d and n > 1]
        if step_index % 4 and can_decode and not saturated:
            assert not prefill
            seen["deferred"] += 1
        elif step_index % 4 == 0:
            seen["admitted_on_beat"] += bool(prefill)
        return batch
    return schedule


def test_the_threshold_caps_verify_steps_too():
    """vLLM applies long_prefill_token_threshold to every running request: with 3 drafts
    and a threshold of 2, a decode verifies 1 draft (2 tokens) and gains at most 2."""
    s = scheduler(num_speculative_tokens=3, acceptance_length=4.0,
                  long_prefill_token_threshold=2)
    r = request("r0", 2, output=9)
    s.add_request(r)
    assert step(s, accepted=4) == {"r0": 2}
    assert step(s, accepted=4) == {"r0": 2}
    assert r.num_output_tokens == 3
