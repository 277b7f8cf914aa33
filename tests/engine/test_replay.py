"""Replay semantics: closed loop (AgentX), open loop (timestamps), determinism, and the
prefix-cache hit rate a trace's hash ids imply."""

import json

import numpy as np
import pandas as pd
import pytest

from support import small_agentx
from labkit import Engine, load_trace


def closed(engine, trace, **kw):
    kw.setdefault("concurrency", 3)
    kw.setdefault("duration_s", 80)
    return engine.replay(trace, **kw)


def test_same_seed_same_results():
    runs = []
    for _ in range(2):
        engine = Engine("tiny-llama", "dp2", "h200", block_size=16, router="session_sticky",
                        seed=7)
        runs.append(closed(engine, small_agentx(5, seed=2)))
    a, b = runs
    drop = {"wall_s", "sim_speed"}
    assert {k: v for k, v in a.summary.items() if k not in drop} == \
        {k: v for k, v in b.summary.items() if k not in drop}
    pd.testing.assert_frame_equal(a.requests, b.requests, check_exact=True)
    pd.testing.assert_frame_equal(a.steps, b.steps, check_exact=True)


def test_seed_changes_the_part_way_starts():
    firsts = set()
    for seed in range(4):
        engine = Engine("tiny-llama", "tp1", "h200", block_size=16, seed=seed)
        result = closed(engine, small_agentx(5, seed=2), start_part_way=True)
        firsts.add(tuple(result.requests.sort_values("arrival_s")["request_id"][:3]))
    assert len(firsts) > 1


def _active_sessions(requests: pd.DataFrame) -> list[tuple[float, float]]:
    spans = requests.groupby("session_id").agg(start=("arrival_s", "min"),
                                                end=("finish_s", "max"))
    return list(spans.itertuples(index=False, name=None))


def test_closed_loop_keeps_concurrency_sessions_in_flight():
    trace = small_agentx(8, seed=4)
    engine = Engine("tiny-llama", "tp1", "h200", block_size=16)
    result = closed(engine, trace, concurrency=3, duration_s=400, start_part_way=False)
    req = result.requests
    done = req[req["completed"]]
    spans = _active_sessions(done.assign(finish_s=done["finish_s"]))
    # at any arrival instant, at most 3 sessions have started and not yet finished
    for t in sorted(req["arrival_s"]):
        live = sum(1 for start, end in spans if start <= t < end)
        assert live <= 3
    # the loop wrapped around: later sessions are replays with fresh ids (salted)
    assert any("@1" in s for s in req["session_id"])
    assert req["request_id"].is_unique


def test_calls_follow_their_parents_and_subagents():
    """A call is sent delay_s after its parent ends; a main call that follows
    subagents also waits for all of them."""
    trace = small_agentx(6, seed=5)
    engine = Engine("tiny-llama", "dp2", "h200", block_size=16, router="session_sticky")
    result = closed(engine, trace, concurrency=6, duration_s=300, start_part_way=False,
                    max_idle_s=5.0, loop_trace=False)
    req = result.requests.set_index("request_id")
    checked_joins = 0
    for tr in trace.requests:
        if tr.request_id not in req.index or tr.parent_id is None:
            continue
        waits_for = [tr.parent_id] + [j.request_id for j in trace.joins(tr)]
        finishes = req.loc[waits_for, "finish_s"]
        ready = finishes.max()
        expected = ready + min(tr.delay_s, 5.0)
        assert req.loc[tr.request_id, "arrival_s"] == pytest.approx(expected, abs=1e-9)
        checked_joins += len(waits_for) > 1
    assert checked_joins > 0


def test_loop_trace_false_replays_each_session_once():
    trace = small_agentx(4, seed=6)
    engine = Engine("tiny-llama", "tp1", "h200", block_size=16)
    result = engine.replay(trace, concurrency=2, start_part_way=False, loop_trace=False)
    assert len(result.requests) == len(trace.requests)
    assert result.requests["completed"].all()
    assert set(result.requests["request_id"]) == {r.request_id for r in trace.requests}


def test_warmup_is_excluded_from_the_summary():
    engine = Engine("tiny-llama", "tp1", "h200", block_size=16)
    result = closed(engine, small_agentx(5, seed=1), duration_s=120, warmup_s=60)
    req = result.requests
    window = req[req["completed"] & (req["arrival_s"] >= 60) & (req["finish_s"] <= 120)]
    assert result.summary["requests_completed"] == len(window)
    tokens = (window["input_tokens"] + window["output_tokens"]).sum()
    assert result.summary["throughput_tok_s_per_gpu"] == pytest.approx(tokens / 60 / 1)


# ------------------------------------------------------------------- Mooncake
def implied_hit_rate(path, block_size: int = 512) -> float:
    """Naive reference: requests in file order, an infinite cache of every prompt
    block seen (a block matches only if its whole prefix matched), at least one token
    recomputed per request."""
    seen: set[tuple] = set()
    hit = total = 0
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            n, ids = r["input_length"], r["hash_ids"]
            full = n // block_size
            prefix, matched, still = (), 0, True
            keys = []
            for j in range(full):
                prefix = prefix + (ids[j],)
                keys.append(prefix)
                if still and prefix in seen:
                    matched += 1
                else:
                    still = False
            hit += min(matched, (n - 1) // block_size) * block_size
            total += n
            seen.update(keys)
    return hit / total


def test_mooncake_hit_rate_matches_its_hash_ids(mooncake_path):
    trace = load_trace(mooncake_path)
    engine = Engine("tiny-llama", "tp1", "h200", block_size=512, max_model_len=1 << 20,
                    num_gpu_blocks_override=200_000)  # never evicts
    result = engine.replay(trace, concurrency=1, loop_trace=False)
    assert result.requests["completed"].all()
    expected = implied_hit_rate(mooncake_path)
    assert result.summary["prefix_cache_hit_rate"] == pytest.approx(expected, rel=1e-12)
    assert 0.5 < expected < 0.8  # a trace with real reuse (not a vacuous match)


def test_mooncake_open_loop_arrives_at_timestamps(mooncake_path):
    trace = load_trace(mooncake_path)
    head = type(trace)(trace.block_size, trace.requests[:300], trace.source, trace.format)
    engine = Engine("llama-3.1-8b", "tp1", "h200", max_model_len=1 << 20)
    result = engine.replay(head, open_loop=True)
    req = result.requests.set_index("request_id")
    stamps = {r.request_id: r.timestamp for r in head.requests}
    assert np.allclose([req.loc[i, "arrival_s"] for i in stamps], list(stamps.values()))
    assert result.requests["completed"].all()
    assert result.summary["sim_duration_s"] >= max(stamps.values())


def test_a_session_keeps_only_the_hints_its_calls_will_inherit():
    """A finished call leaves a prefix hint (its whole prefix's blocks) for the calls
    that continue it — the next main call, the subagents it forks. Each of those gets
    it; once the last has, the session lets it go (kept for every finished call, they
    piled up for the whole session)."""
    from labkit.engine.replay import start_replay

    trace = small_agentx(6, seed=4)
    children = pd.Series([r.parent_id for r in trace.requests]).value_counts()
    assert (children > 1).any()  # some call is continued by more than one
    engine = Engine("tiny-llama", "dp2", "h200", block_size=16, max_model_len=1 << 20)
    run = start_replay(engine, trace, concurrency=3, duration_s=120)
    feeder, submit, inherited, looks = run.feeder, engine.submit, [], [0]

    def spy(req, at):
        inherited.append((req.parent_id, req.prefix_hint))
        return submit(req, at=at)

    def look(req, t):  # after the feeder's own callback
        for hints in feeder._hints.values():
            for eid in hints:
                assert feeder._children_left.get(eid, 0) > 0, f"{eid}'s hint is kept for nobody"
        looks[0] += 1

    engine.submit = spy
    engine.finish_callbacks.append(look)
    run.finish(False)
    continued = [hint for parent, hint in inherited if parent is not None]
    assert looks[0] > 20 and len(continued) > 20
    assert all(hint is not None for hint in continued)  # every one got its parent's


def test_blocks_the_trace_does_not_name_get_small_keys():
    """A call's output blocks that no later call re-sends get ids the feeder invents,
    numbered on from the trace's largest: distinct from every id of the trace and from
    each other, and small enough that the prefix cache's index keeps them in its array
    (its dict, the slow way, stays empty -- it took every decode block of an open-loop
    load when the ids started at 2**40)."""
    from labkit.traces import generate_random_trace

    trace = generate_random_trace(num_prompts=40, request_rate=20.0, input_len=200,
                                  output_len=120, seed=3)
    engine = Engine("tiny-llama", "dp2", "h200", block_size=16)
    result = engine.replay(trace, open_loop=True)
    assert len(result.requests) == 40
    made = np.concatenate([ids[ids > trace.max_hash_id] for ids in
                           (np.asarray(r.keys.ids) for r in engine.requests.values())])
    assert len(made) > 40 and len(np.unique(made)) == len(made)  # new, and each once
    assert made.min() == trace.max_hash_id + 1
    pools = [s.kv.pool for s in engine.schedulers]
    assert sum(p.num_cached for p in pools) > 0
    assert all(not p._cached._other for p in pools)
