"""Fast-forward (runs of steady decode steps simulated at once) must change nothing:
the same replay step by step and fast-forwarded gives identical tables, bit for bit."""

import pandas as pd
import pytest

from support import small_agentx
from labkit import Engine
from labkit.engine.events import BlocksAllocated, BlocksCached, RequestTokens

CONFIGS = {
    "single rank": dict(model="tiny-llama", layout="tp1"),
    "spec decode": dict(model="tiny-llama", layout="tp1", num_speculative_tokens=3,
                        acceptance_length=2.99),
    "dp3 sticky": dict(model="tiny-llama", layout="dp3", router="session_sticky"),
    "dp2 prefix-aware": dict(model="tiny-llama", layout="dp2", router="prefix_aware"),
    "dp3 round-robin, KV fetched on moves": dict(model="tiny-llama", layout="dp3",
                                                 router="round_robin"),
    # KV fetched across nodes takes several steps: runs go on while it is on the wire
    "tp8xdp2 round-robin, KV fetched across nodes": dict(model="llama-3.1-8b",
                                                         layout="tp8xdp2",
                                                         router="round_robin"),
    "dp2 least-kv, tight KV": dict(model="tiny-llama", layout="dp2", router="least_kv",
                                   num_gpu_blocks_override=1400),
    "dep4 lockstep": dict(model="tiny-qwen3-moe", layout="dep4", num_speculative_tokens=2,
                          acceptance_length=2.5, router="least_loaded"),
    "preemption pressure": dict(model="tiny-llama", layout="tp1",
                                num_gpu_blocks_override=1000, max_num_seqs=8),
    "sliding window": dict(model="tiny-gpt-oss", layout="tp1", num_speculative_tokens=2,
                           acceptance_length=2.5),
    "sliding window, tight KV": dict(model="tiny-gpt-oss", layout="dp2",
                                     num_gpu_blocks_override=1500, max_num_seqs=8),
}


def replay(ff: bool, cfg: dict, block_events: bool = False):
    engine = Engine(hardware="h100", block_size=16, sim_fast_forward=ff, **cfg)
    log = []
    if block_events:
        engine.events.subscribe(lambda e: log.append((type(e).__name__, e.t, e.rank,
                                                      e.request_id, e.blocks.tolist())),
                                BlocksAllocated, BlocksCached)
    # part-way starts: long contexts from the first step, so KV pressure bites
    result = engine.replay(small_agentx(6, seed=3), concurrency=4, duration_s=60,
                           max_idle_s=2.0, start_part_way=True)
    return result, log


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fast_forward_is_exact(name):
    fast, _ = replay(True, CONFIGS[name])
    slow, _ = replay(False, CONFIGS[name])
    assert slow.summary["requests_completed"] > 10
    pd.testing.assert_frame_equal(fast.requests, slow.requests, check_exact=True)
    pd.testing.assert_frame_equal(fast.steps, slow.steps, check_exact=True)
    drop = {"wall_s", "sim_speed"}
    assert {k: v for k, v in fast.summary.items() if k not in drop} == \
        {k: v for k, v in slow.summary.items() if k not in drop}
    if name == "preemption pressure":
        assert slow.summary["preemptions"] > 0


def test_fast_forward_emits_the_same_block_events():
    cfg = CONFIGS["spec decode"]
    _, fast = replay(True, cfg, block_events=True)
    _, slow = replay(False, cfg, block_events=True)
    assert len(slow) > 100
    assert sorted(fast) == sorted(slow)


def test_fast_forward_really_skips_steps():
    """The point of it: far fewer plan/commit rounds for the same steps."""
    counts = {}
    for ff in (True, False):
        engine = Engine("tiny-llama", "tp1", "h100", block_size=16, sim_fast_forward=ff)
        result = engine.replay(small_agentx(4, seed=1), concurrency=2, duration_s=60)
        chunks = engine.step_recorder.num_events  # one per committed plan
        counts[ff] = (chunks, len(result.steps))
    assert counts[True][1] == counts[False][1]  # the same steps...
    assert counts[True][0] < counts[False][0] / 3  # ...in far fewer rounds


def test_fast_forward_reports_the_same_request_tokens():
    """Runs go on while a moved call's KV is on the wire (it sits them out): the
    per-step RequestTokens rows, the waiting call's included, are those of single steps.
    (Two tp8 replicas on two nodes: a moved call's KV crosses the network for several
    steps; a tiny model's would land within one.)"""
    cfg = CONFIGS["tp8xdp2 round-robin, KV fetched across nodes"]
    rows = {}
    for ff in (True, False):
        engine = Engine(hardware="h100", block_size=16, sim_fast_forward=ff, **cfg)
        log = rows[ff] = []

        def per_step(e, log=log):
            for j, step in enumerate(e.step_index.tolist()):
                log.append((e.instance, step, tuple(e.request_ids), tuple(e.ranks.tolist()),
                            tuple(e.context[j].tolist()), tuple(e.num_new[j].tolist()),
                            tuple(e.decode[j].tolist()), tuple(e.held[j].tolist())))

        engine.events.subscribe(per_step, RequestTokens)
        result = engine.replay(small_agentx(6, seed=3), concurrency=4, duration_s=60,
                               max_idle_s=2.0, start_part_way=True)
        if ff:
            assert result.summary["kv_fetched_tokens"] > 0
    waited = [r for r in rows[False] if 0 in r[5]]
    assert waited  # some steps ran while a call's KV was on the wire
    assert sorted(rows[True]) == sorted(rows[False])
