"""Sliding-window layers: a second table per request whose blocks are freed as they
leave the window, prefix hits that need the window, and the engine around them."""

import dataclasses

import numpy as np
import pytest

from labkit import Engine
from labkit.engine.events import BlocksAllocated, WindowSlid
from labkit.engine.kv import BlockPool, KVManager, TraceBlockKeys
from labkit.engine.kv.sliding_window import SlidingWindow
from labkit.engine.request import Request
from labkit.errors import ConfigError
from labkit.specs import get_model
from tests.support import small_agentx

BS = 4


def manager(window=6, pages=1, blocks=128):
    pool = BlockPool(blocks)
    window = SlidingWindow(pool, BS, window, pages, pool.events)
    return KVManager(blocks, BS, pool=pool, window=window)


def request(rid, ids, prompt_tokens, output=8):
    req = Request(rid, "s", prompt_tokens, output, 0.0)
    req.keys = TraceBlockKeys(np.asarray(ids, dtype=np.int64), BS, BS)
    return req


def step(kv, req, n, match=None):
    """Allocate n tokens (from the match for a new request), compute them, cache."""
    if match is not None:
        assert kv.allocate(req, n, match)
        req.num_computed_tokens = match.num_tokens
    else:
        assert kv.allocate(req, n)
    req.num_computed_tokens += n
    kv.cache_full_blocks(req)


def held_window_blocks(kv, rid):
    return np.nonzero(kv.window_table(rid) >= 0)[0].tolist()


def check_conservation(kv):
    """Every reference the pool counts is a table entry, and the other way round."""
    refs = np.zeros(kv.num_blocks, dtype=np.int64)
    for table in kv.tables.values():
        np.add.at(refs, table.view(), 1)
    for table in kv.window.tables.values():
        np.add.at(refs, table.live(), 1)
    assert (refs == kv.pool.ref_count).all()
    assert kv.pool.num_used == int((refs > 0).sum())


@pytest.mark.parametrize("window", [1, 4, 6, 9])
def test_the_window_table_holds_exactly_the_blocks_the_next_queries_read(window):
    kv = manager(window)
    req = request("a", range(100, 140), 150)
    computed = 0
    for n in (13, 1, 1, 7, 1, 1, 1, 2, 20, 1):
        step(kv, req, n, kv.lookup(req) if computed == 0 else None)
        computed += n
        # before the next step the window slides to `computed`; during it tokens
        # computed .. computed + 1 are written: blocks from the first position any of
        # the next queries reads, (computed - window + 1), up to the new token's block
        assert kv.allocate(req, 1)
        first = max(0, computed - window + 1) // BS
        assert held_window_blocks(kv, "a") == list(range(first, computed // BS + 1))
        assert len(kv.table("a")) == computed // BS + 1  # full attention keeps all
        check_conservation(kv)


def test_blocks_that_left_the_window_are_reused_by_another_request():
    kv = manager(window=4, blocks=30)
    slid = []
    kv.events.subscribe(lambda e: slid.extend(e.blocks.tolist()), WindowSlid)
    a = request("a", range(100, 108), 32)
    step(kv, a, 32, kv.lookup(a))
    assert kv.allocate(a, 1)  # slides: blocks 0..6 of its window table are gone
    assert len(slid) == 7 and kv.window.pages_slid == 7
    assert not set(slid) & set(kv.window_table("a").tolist())
    b = request("b", range(200, 208), 32)
    allocated = []
    kv.events.subscribe(lambda e: allocated.extend(e.blocks.tolist()), BlocksAllocated)
    step(kv, b, 32, kv.lookup(b))
    # 30 blocks: a took 18 and holds 9 full + 2 window pages; b needs 8 + 8, more
    # than the 12 never used: it runs on pages a's window left behind
    assert set(slid) & (set(allocated) | set(kv.window_table("b").tolist()))
    check_conservation(kv)


def naive_usable(kv, req, cached_full_blocks):
    """Longest m <= cached_full_blocks whose window blocks m-need .. m-1 are all cached."""
    need = kv.window.hit_blocks
    for m in range(cached_full_blocks, -1, -1):
        keys = [req.keys.key(j) for j in range(max(0, m - need), m)]
        if all(kv.window._cached_pages(k) is not None for k in keys):
            return m
    return 0


@pytest.mark.parametrize("seed", range(6))
def test_prefix_hits_need_the_window_pages_of_the_prefix_end(seed):
    rng = np.random.default_rng(seed)
    window = int(rng.integers(2, 14))
    kv = manager(window, pages=int(rng.integers(1, 3)), blocks=400)
    first = request("a", range(500, 530), 120)
    step(kv, first, 120, kv.lookup(first))
    first.finish_s = 1.0
    kv.free(first)
    # knock random window pages (and sometimes a full block) out of the cache
    for j in rng.choice(30, size=int(rng.integers(0, 8)), replace=False):
        pages = kv.window._cached_pages(first.keys.key(int(j)))
        if pages is not None:
            kv.pool._evict(pages)
    again = request("b", range(500, 531), 124)
    match = kv.lookup(again)
    cached_full = match.cached_blocks
    assert match.num_tokens == naive_usable(kv, again, cached_full) * BS
    # the hit keeps exactly the last hit_blocks window pages (fewer if the prefix is short)
    blocks = match.num_tokens // BS
    assert len(match.window_pages) == min(kv.window.hit_blocks, blocks)
    step(kv, again, again.num_prompt_tokens - match.num_tokens, match)
    check_conservation(kv)
    held = held_window_blocks(kv, "b")
    assert held[0] <= max(0, match.num_tokens - window + 1) // BS or not match.num_tokens


def test_an_agentic_next_call_hits_its_whole_context():
    kv = manager(window=10)
    call1 = request("a", range(100, 116), 64)
    step(kv, call1, 64, kv.lookup(call1))
    step(kv, call1, 1)
    call1.finish_s = 1.0
    kv.free(call1)
    call2 = request("b", range(100, 125), 100)
    match = kv.lookup(call2)
    assert match.num_tokens == 64  # every full block, and the window behind its end
    assert kv.pool.num_used == 0  # nothing held between calls


def test_copy_on_write_and_fork_in_the_window_table():
    kv = manager(window=6)
    parent = request("p", range(100, 110), 40)
    step(kv, parent, 30, kv.lookup(parent))  # 30 tokens: block 7 is half full
    child = request("c", range(100, 110), 40)
    kv.fork(parent, child, 30)
    shared = kv.window_table("c")[7]
    assert shared == kv.window_table("p")[7] and kv.pool.ref_count[shared] == 2
    assert kv.tail_is_shared(child)
    step(kv, child, 1)
    assert kv.window_table("c")[7] != shared  # copied before writing
    assert (shared, kv.window_table("c")[7]) in child.pending_copies
    check_conservation(kv)
    step(kv, parent, 9)  # parent moves on: its window no longer covers token 20
    late = request("l", range(100, 110), 40)
    with pytest.raises(ValueError, match="sliding window has moved past"):
        kv.fork(parent, late, 20)


@pytest.mark.parametrize("seed", range(4))
def test_random_schedules_conserve_blocks(seed):
    """Many requests, random chunks, preemptions and finishes: pool references equal
    table entries after every operation, and every block is free at the end."""
    rng = np.random.default_rng(seed)
    kv = manager(window=int(rng.integers(1, 12)), pages=int(rng.integers(1, 3)), blocks=60)
    live, n = [], 0
    for _ in range(300):
        if len(live) < 4 and rng.random() < 0.3:
            base = int(rng.integers(0, 3)) * 1000  # shared prefixes between requests
            req = request(f"r{n}", range(base, base + 20), int(rng.integers(5, 70)), 30)
            n += 1
            match = kv.lookup(req)
            pending = req.num_prompt_tokens - match.num_tokens
            if kv.allocate(req, pending, match):
                req.num_computed_tokens = match.num_tokens + pending
                kv.cache_full_blocks(req)
                live.append(req)
        elif live:
            req = live[int(rng.integers(len(live)))]
            if rng.random() < 0.15 or req.num_computed_tokens >= req.max_tokens - 1:
                req.finish_s = 1.0 if rng.random() < 0.7 else None
                kv.free(req)
                live.remove(req)
            elif kv.allocate(req, 1):
                req.num_computed_tokens += 1
                kv.cache_full_blocks(req)
        check_conservation(kv)
    for req in live:
        kv.free(req)
    assert kv.pool.num_used == 0


# ---------------------------------------------------------------- the engine
def test_gpt_oss_holds_less_kv_than_the_same_model_without_windows():
    trace = small_agentx(4)
    full = dataclasses.replace(get_model("gpt-oss-120b"), name="gpt-oss-all-full",
                               sliding_window_layers=(), sliding_window=0)
    held = {}
    for model in (get_model("gpt-oss-120b"), full):
        engine = Engine(model=model, layout="tp2", num_gpu_blocks_override=200_000)
        result = engine.replay(trace, concurrency=4, duration_s=60)
        page = engine.block_size * engine.placement.kv_bytes_per_token_per_gpu()
        held[model.name] = float(result.steps["kv_used_blocks"].max()) * page
        if model.sliding_window_layers:
            assert result.summary["kv_window_blocks_freed"] > 0
            assert result.summary["requests_completed"] > 0
    # half the layers keep everything in both; the other half keep a window (plus the
    # chunk being prefilled) instead of the whole context
    ratio = held["gpt-oss-120b"] / held["gpt-oss-all-full"]
    assert 0.5 <= ratio < 0.7


@pytest.mark.parametrize("layout", ["tp2xdcp2", "pcp2"])
def test_token_sharded_layouts_are_refused_before_the_run(layout):
    with pytest.raises(ConfigError, match="does not model for sliding-window KV"):
        Engine(model="gpt-oss-120b", layout=layout)


# ------------------------------------------------------- capacity and step costs
def test_capacity_counts_the_window_not_the_context():
    from labkit.engine.capacity import capacity

    ctx, block, window = 131072, 16, 128
    r = capacity("gpt-oss-120b", "tp2", context=ctx)
    # tp2 splits the 8 KV heads: 4 heads x 64 dims x (key + value) x bf16 per layer
    per_layer = 4 * 64 * 2 * 2
    assert r["persistent_kv_bytes_per_gpu"] == (ctx + window) * 18 * per_layer
    # 8192 blocks of the full layers; the window still holds blocks 8184 .. 8191
    per_request = ctx // block + (ctx // block - (ctx - window + 1) // block)
    assert per_request == 8200
    expected = r["kv_capacity_tokens_per_gpu"] // block // per_request
    assert r["max_concurrent_requests"] == min(expected, 1024)  # max_num_seqs default
    full = capacity(_all_full(), "tp2", context=ctx)
    assert r["max_concurrent_requests"] > 1.9 * full["max_concurrent_requests"]


def _all_full():
    return dataclasses.replace(get_model("gpt-oss-120b"), name="gpt-oss-all-full",
                               sliding_window_layers=(), sliding_window=0)


def _decode_step_s(engine, requests, ctx):
    from labkit.engine.run_plan import decode_work

    work = decode_work(np.array([requests]), np.array([requests * ctx]), np.array([0]), 1)
    return float(engine.cost_model.step_timing(work, False).duration[0])


@pytest.mark.parametrize("cost_model", ["calibrated", "roofline"])
def test_window_layers_cost_like_full_ones_within_the_window_and_flat_beyond(cost_model):
    swa = Engine(model="gpt-oss-120b", layout="tp2", cost_model=cost_model)
    full = Engine(model=_all_full(), layout="tp2", cost_model=cost_model)
    short = 100  # < the 128-token window: both read the same keys
    assert _decode_step_s(swa, 8, short) == pytest.approx(_decode_step_s(full, 8, short))
    long1, long2 = 32_000, 64_000
    grow_swa = _decode_step_s(swa, 8, long2) - _decode_step_s(swa, 8, long1)
    grow_full = _decode_step_s(full, 8, long2) - _decode_step_s(full, 8, long1)
    assert grow_full > 0
    # past the window only the 18 full-attention layers grow with the context
    if cost_model == "calibrated":
        assert grow_swa == pytest.approx(grow_full / 2, rel=1e-9)
    else:  # the roofline is max(compute, memory): growth at most half
        assert 0 < grow_swa <= grow_full / 2 * (1 + 1e-9)


def test_a_long_prefill_chunk_is_priced_by_its_window():
    from labkit.engine.step_work import StepWork

    def prefill_s(engine, new):
        one = np.array([[new]])
        z = np.zeros((1, 1), dtype=np.int64)
        work = StepWork(one, z, np.ones((1, 1), dtype=np.int64), z, one,
                        one * (one + 1) // 2, z, np.zeros((1, 1), dtype=bool),
                        prefill_chunks=(np.array([0]), np.array([new]), np.array([0]),
                                        np.array([0])))
        return float(engine.cost_model.step_timing(work, False).duration[0])

    swa = Engine(model="gpt-oss-120b", layout="tp2")
    full = Engine(model=_all_full(), layout="tp2")
    assert prefill_s(swa, 100) == pytest.approx(prefill_s(full, 100))
    assert prefill_s(swa, 16_384) < prefill_s(full, 16_384)


def test_kv_copied_in_keeps_only_the_window_at_its_end():
    """A prefix fetched from another rank arrives with its KV: no query here reads its
    early blocks, so only the window at its end takes pages."""
    kv = manager(window=6)
    req = request("a", range(100, 125), 100)
    assert kv.allocate(req, 80, kv.lookup(req), copied=True)
    req.num_computed_tokens = 80
    assert len(kv.table("a")) == 20
    assert held_window_blocks(kv, "a") == list(range((80 - 6 + 1) // BS, 20))
    check_conservation(kv)
    step(kv, req, 20)  # then computes on as usual
    assert held_window_blocks(kv, "a")[0] == (80 - 6 + 1) // BS
    check_conservation(kv)
