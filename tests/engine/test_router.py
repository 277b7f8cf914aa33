"""Routing policies across DP ranks."""

import numpy as np

from support import small_agentx
from labkit import Engine
from labkit.engine.events import RequestRouted


def routed(router: str, layout: str = "dp3", sessions: int = 6, **kw):
    engine = Engine("llama-3.1-8b", layout, "h200", router=router, **kw)
    decisions = []
    engine.events.subscribe(decisions.append, RequestRouted)
    result = engine.replay(small_agentx(sessions, seed=9), concurrency=6, duration_s=40,
                           start_part_way=False)
    return engine, decisions, result


def test_round_robin_cycles():
    _, decisions, _ = routed("round_robin")
    assert [d.rank for d in decisions[:9]] == [0, 1, 2] * 3


def test_least_loaded_picks_the_smallest_waiting_times_4_plus_running():
    _, decisions, _ = routed("least_loaded")
    for d in decisions:
        assert d.scores[d.rank] == min(d.scores)
        assert d.rank == int(np.argmin(d.scores))  # ties: the lowest rank


def test_session_sticky_keeps_every_call_of_a_session_on_one_rank():
    _, _, result = routed("session_sticky")
    ranks = result.requests.groupby("session_id")["rank"].nunique()
    assert (ranks == 1).all() and result.requests["rank"].nunique() > 1


def test_sticky_and_prefix_aware_reuse_more_than_round_robin():
    rates = {p: routed(p, session_kv_migration="recompute")[2].summary["prefix_cache_hit_rate"]
             for p in ("round_robin", "session_sticky", "prefix_aware")}
    assert rates["session_sticky"] > rates["round_robin"]
    assert rates["prefix_aware"] > rates["round_robin"]


def test_prefix_aware_prefers_the_rank_holding_the_prefix():
    _, decisions, _ = routed("prefix_aware")
    scored = [d for d in decisions if isinstance(d.scores[0], tuple)]
    assert scored
    for d in scored:
        best = min(d.scores)
        assert d.scores[d.rank] == best
    assert any(d.scores[d.rank][0] < 0 for d in scored)  # found a cached prefix


def test_least_kv_picks_the_emptiest_cache():
    _, decisions, _ = routed("least_kv")
    assert all(d.scores[d.rank] == min(d.scores) for d in decisions)


def test_least_running_tokens_counts_contexts_in_flight():
    engine = Engine("llama-3.1-8b", "dp3", "h200", router="least_running_tokens")
    checked = []

    def check(event):  # runs while routing: the ranks are as the router saw them
        expected = [sum(r.num_prompt_tokens + r.num_output_tokens
                        for r in list(s.running) + list(s.waiting))
                    for s in engine.schedulers]
        assert event.scores == expected
        assert event.rank == expected.index(min(expected))
        checked.append(max(expected))

    engine.events.subscribe(check, RequestRouted)
    engine.replay(small_agentx(6, seed=9), concurrency=6, duration_s=40, start_part_way=False)
    assert len(checked) > 10 and max(checked) > 0


def test_moving_a_session_fetches_its_kv_and_holds_blocks_meanwhile():
    engine, decisions, result = routed("round_robin")
    req = result.requests
    moved = req[req["fetched_tokens"] > 0]
    assert len(moved) > 5
    # the fetched prefix is served, not recomputed
    assert (moved["computed_prefill_tokens"] <= moved["input_tokens"]
            - moved["cached_tokens"]).all()
    # the transfer delays the first token by at least bytes / NVLink bandwidth
    per_token = engine.placement.kv_bytes_per_token_per_gpu()
    floor = moved["fetched_tokens"] * per_token / engine.hardware.nvlink_bandwidth
    served = moved["first_token_s"].notna()  # (calls still prefilling at the end have none)
    assert served.sum() > 5
    moved, floor = moved[served], floor[served]
    assert (moved["first_token_s"] - moved["first_scheduled_s"] >= floor).all()
    sticky = routed("session_sticky")[2].requests
    assert (sticky["fetched_tokens"] == 0).all()
