"""Hybrid models: a prefix hit needs the KV blocks *and* a linear-state snapshot."""

import numpy as np
import pytest

from labkit import Engine
from labkit.engine.kv import BlockPool, KVManager, TraceBlockKeys
from labkit.engine.kv.state_snapshots import StateSnapshots
from labkit.engine.request import Request
from tests.support import small_agentx

BS = 4


def manager(retention="both", pages=2, blocks=64):
    pool = BlockPool(blocks)
    return KVManager(blocks, BS, pool=pool, snapshots=StateSnapshots(pool, pages, retention))


def request(rid, ids, prompt_tokens, output=4):
    req = Request(rid, "s", prompt_tokens, output, 0.0)
    req.keys = TraceBlockKeys(np.asarray(ids, dtype=np.int64), BS, BS)
    return req


def run_call(kv, req):
    """Admit with the cached prefix, compute the prompt, finish (as a scheduler does)."""
    match = kv.lookup(req)
    assert kv.allocate(req, req.num_prompt_tokens - match.num_tokens, match)
    req.num_computed_tokens = req.num_prompt_tokens
    kv.cache_full_blocks(req)
    req.finish_s = 1.0
    kv.free(req)
    return match


def test_a_snapshot_takes_pages_of_the_pool_that_stay_evictable():
    kv = manager(pages=3)
    free_before = kv.pool.num_free
    assert kv.snapshots.save(12345, "call_end")
    assert kv.snapshots.has(12345) and not kv.snapshots.has(999)
    assert kv.pool.num_cached == 3 and kv.pool.num_free == free_before  # cached, not used
    full = manager(pages=3, blocks=4)
    held = full.pool.allocate(2)
    assert not full.snapshots.save(1, "call_end")  # no room: never evicts a used block
    assert full.snapshots.stats.skipped_no_space == 1
    full.pool.free(held)


def test_without_a_snapshot_cached_kv_gives_no_hit():
    kv = manager("none")
    first = request("a", range(10, 16), 24)  # 6 blocks
    run_call(kv, first)
    again = request("b", range(10, 18), 32)
    assert kv.pool.cached_block(again.keys.key(5)) >= 0  # its KV is all there
    match = kv.lookup(again)
    assert match.num_tokens == 0 and match.cached_blocks == 6


def test_interval_retention_snapshots_the_end_of_every_call():
    kv = manager("interval")
    run_call(kv, request("a", range(10, 16), 22))  # 5 full blocks and 2 tokens
    again = request("b", range(10, 18), 32)
    match = kv.lookup(again)
    assert match.num_tokens == 5 * BS  # up to the last full block of the call
    assert kv.snapshots.stats.saved_at_call_end == 1


def test_selective_retention_saves_where_a_prefix_is_seen_again():
    kv = manager("selective")
    run_call(kv, request("a", range(10, 16), 24))
    second = request("b", range(10, 20), 40)
    match = run_call(kv, second)  # KV cached for 6 blocks, no state: recompute all
    assert match.num_tokens == 0 and match.checkpoint_blocks == 6
    assert kv.snapshots.stats.saved_on_second_sight == 1
    third = request("c", list(range(10, 16)) + [77, 78, 79], 36)  # shares 6 blocks
    assert kv.lookup(third).num_tokens == 6 * BS


def test_an_overwritten_state_falls_back_to_an_earlier_snapshot():
    kv = manager("interval")
    run_call(kv, request("a", range(10, 13), 12))  # snapshot after 3 blocks
    run_call(kv, request("b", range(10, 16), 24))  # snapshot after 6 blocks (hits 3)
    probe = request("c", range(10, 20), 40)
    assert kv.lookup(probe).num_tokens == 6 * BS
    pages = [kv.pool.cached_block(int(k)) for k in kv.snapshots._keys(probe.keys.key(5))]
    kv.pool._evict(np.array(pages, dtype=np.int32))  # the newer state was overwritten
    match = kv.lookup(probe)
    assert match.num_tokens == 3 * BS and match.cached_blocks == 6


def test_non_hybrid_models_keep_plain_prefix_caching():
    assert all(s.kv.snapshots is None for s in Engine("llama-3.1-8b").schedulers)
    hybrid = Engine("kimi-linear-48b-a3b")
    snaps = hybrid.schedulers[0].kv.snapshots
    page = hybrid.block_size * hybrid.placement.kv_bytes_per_token_per_gpu()
    assert snaps.pages == int(np.ceil(hybrid.placement.state_bytes_per_gpu() / page))


@pytest.fixture(scope="module")
def replays():
    trace = small_agentx(8, seed=1)
    return {ret: Engine("kimi-linear-48b-a3b", "tp1", "h200", linear_state_retention=ret)
            .replay(trace, concurrency=8, duration_s=60).summary
            for ret in ("both", "interval", "selective", "none")}


def test_retention_policies_order_the_hit_rates(replays):
    hit = {k: v["prefix_cache_hit_rate"] for k, v in replays.items()}
    assert hit["none"] == 0.0
    assert hit["both"] >= max(hit["interval"], hit["selective"]) - 1e-9
    assert min(hit["interval"], hit["selective"]) > 0.5
    assert replays["none"]["linear_state_tokens_recomputed"] > \
        10 * replays["both"]["linear_state_tokens_recomputed"]
    assert replays["interval"]["linear_state_saved_on_second_sight"] == 0
    assert replays["selective"]["linear_state_saved_at_call_end"] == 0
