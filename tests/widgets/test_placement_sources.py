"""Where each stretch of a request's KV came from, and the view over a fast-forwarded run.

The references are the engine's own per-request counters (`num_cached_tokens`,
`num_offload_tokens`, the P/D transfer log), kept by code the view never reads.
"""

import pandas as pd
import pytest

from labkit import Engine
from labkit.engine.disagg import PDEngine
from labkit.engine.events import Forked
from labkit.engine.replay import start_replay
from labkit.widgets import KVPlacementView
from support import small_agentx

DSV3 = "deepseek-v3"


def spans(frame: pd.DataFrame, rid: str, gpu: int = 0) -> list[tuple[int, int, str]]:
    rows = frame[(frame.request_id == rid) & (frame.gpu == gpu) & (frame.kind == "persistent")]
    return list(zip(rows.start, rows.end, rows.source))


def replay(engine, sessions=8, seed=5, concurrency=6, duration_s=300):
    start_replay(engine, small_agentx(sessions, seed=seed), concurrency=concurrency,
                 duration_s=duration_s, start_part_way=False)


def test_prefix_cache_hits_and_forks_show_as_cached_and_forked():
    engine = Engine(model=DSV3, layout="tp8", hardware="h200", max_model_len=1 << 20)
    view = KVPlacementView(engine)
    forked = set()
    engine.events.subscribe(lambda e: forked.add(e.child_id), Forked)
    replay(engine)
    seen = {"cached": 0, "forked": 0}
    while engine.step() and min(seen.values()) < 5:
        frame = view.placement()
        for rid in frame.request_id.unique():
            req = engine.requests[rid]
            if req.num_preemptions or req.num_fetched_tokens or req.num_offload_tokens:
                continue
            runs = spans(frame, rid)
            source = "forked" if rid in forked else "cached"
            reused = [(a, b) for a, b, s in runs if s != "computed"]
            assert {s for *_, s in runs} <= {source, "computed"}
            assert (reused[-1][1] if reused else 0) == req.num_cached_tokens
            assert runs[-1][1] == req.num_computed_tokens
            seen[source] += bool(reused)
    assert min(seen.values()) >= 5


@pytest.mark.parametrize("layout,knobs,counter,source", [
    # a prefix evicted from the GPUs but kept by the node's CPU tier
    ("tp8", dict(num_gpu_blocks_override=400, cpu_kv_gib=64), "num_offload_tokens", "loaded"),
    # a session routed away from the rank that caches it: its prefix is fetched
    ("dep8", dict(session_kv_migration="fetch"), "num_fetched_tokens", "transferred"),
])
def test_prefixes_from_elsewhere_show_where_they_came_from(layout, knobs, counter, source):
    engine = Engine(model=DSV3, layout=layout, hardware="h200", max_model_len=1 << 20,
                    **knobs)
    view = KVPlacementView(engine)
    replay(engine, sessions=10, concurrency=4, duration_s=600)
    seen = 0
    while engine.step() and seen < 5:
        frame = view.placement()
        for rid in frame.request_id.unique():
            req = engine.requests[rid]
            if not getattr(req, counter) or req.num_preemptions:
                continue
            moved = [(a, b) for a, b, s in spans(frame, rid, frame[frame.request_id == rid]
                                                 .gpu.iloc[0]) if s == source]
            end = req.num_cached_tokens  # cached here + brought over, at admission
            assert moved == [(end - getattr(req, counter), end)]
            seen += 1
    assert seen >= 5


def test_pd_transferred_prompts_show_as_transferred():
    pd_engine = PDEngine(DSV3, "tp8", "tp8", "h200", max_model_len=1 << 20)
    view = KVPlacementView(pd_engine.decode[0])
    replay(pd_engine, sessions=6, concurrency=4, duration_s=300)
    checked = partial = 0
    while pd_engine.step() and (checked < 10 or not partial):
        frame = view.placement()
        log = {t["request_id"]: t for t in pd_engine.transfers}
        for rid in frame.request_id.unique():
            if rid not in log:
                continue
            t = log[rid]
            runs = spans(frame, rid)
            moved = [(a, b) for a, b, s in runs if s == "transferred"]
            start = t["decode_cached_tokens"]
            assert moved == [(start, start + t["tokens"])]
            assert [(a, b) for a, b, s in runs if s == "cached"] == ([(0, start)] if start else [])
            checked += 1
            partial += start > 0  # the decode group cached the session's earlier calls
    assert checked >= 10 and partial


def test_fast_forward_shows_the_same_placement_at_every_step(layout="dep8"):
    frames = {}
    for ff in (False, True):
        engine = Engine(model=DSV3, layout=layout, hardware="h200", max_model_len=1 << 20,
                        sim_fast_forward=ff)
        view = KVPlacementView(engine)
        replay(engine, sessions=6, seed=3, concurrency=4, duration_s=15)
        while engine.step():
            pass
        steps = view.model.steps_done
        frames[ff] = [view.placement(k) for k in range(1, steps + 1, 5)]
    assert len(frames[True]) == len(frames[False]) > 20
    for slow, fast in zip(frames[False], frames[True]):
        pd.testing.assert_frame_equal(slow, fast)
    assert sum(len(f) for f in frames[True]) > 0
