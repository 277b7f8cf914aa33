"""KV offload in the engine (sim plane): write-through, load or recompute, async loads."""

import dataclasses
import json

import pytest

from labkit import Engine, get_hardware
from labkit.engine.events import KVLoadDeclined, KVLoaded, KVOffloaded
from labkit.engine.kv.packing import DMA_DESCRIPTOR_S
from labkit.errors import ConfigError
from tests.support import small_agentx

PREFIX = list(range(1000, 3048))  # 2048 tokens: 128 blocks of 16
OTHER = list(range(50_000, 51_600))  # 100 blocks' worth of other traffic


def evicted_then_reused(hardware="h200", **knobs):
    """A prompt runs; other traffic pushes its KV out of a small GPU pool; the prompt
    comes back with 64 new tokens. Returns the engine, its events, the last request."""
    engine = Engine("llama-3.1-8b", "tp1", hardware, num_gpu_blocks_override=160,
                    cpu_kv_gib=knobs.pop("cpu_kv_gib", 4), **knobs)
    events = []
    engine.events.subscribe(events.append, KVLoaded, KVLoadDeclined, KVOffloaded)
    engine.submit_prompt(PREFIX, 4, request_id="first")
    engine.run_until()
    engine.submit_prompt(OTHER, 4, request_id="other")
    engine.run_until()
    again = engine.submit_prompt(PREFIX + list(range(7, 71)), 4, request_id="again")
    engine.run_until()
    return engine, events, again


def test_a_prefix_evicted_from_the_gpu_is_loaded_from_the_cpu_tier():
    engine, events, again = evicted_then_reused()
    loaded = [e for e in events if isinstance(e, KVLoaded)]
    assert [e.request_id for e in loaded] == ["again"]
    e = loaded[0]
    # what the GPU lost of the prefix comes back from host memory: all of it is served
    assert again.num_cached_tokens == len(PREFIX) and 0 < e.num_tokens < len(PREFIX)
    assert e.tokens_by_tier == {"cpu": e.num_tokens}
    assert again.num_offload_tokens == e.num_tokens
    # what is computed is only what no tier had
    assert again.num_computed_prefill_tokens == again.num_prompt_tokens - len(PREFIX)
    # the load takes latency + each GPU's share over PCIe, and delays the first token
    hw, blocks = engine.hardware, e.num_tokens // engine.block_size
    per_gpu = engine.block_size * engine.placement.kv_bytes_per_token_per_gpu()
    descriptors = 32 * 2  # per-layer buffers: 32 layers x (K, V) regions per block
    expected = hw.host_link_latency_s + blocks * per_gpu / hw.pcie_bandwidth \
        + blocks * descriptors * DMA_DESCRIPTOR_S
    assert e.seconds == pytest.approx(expected, rel=1e-9)
    assert again.first_token_s - again.first_scheduled_s >= expected
    stats = engine.offload.summary()
    assert stats["cpu_tier_hit_blocks"] == blocks
    stored = sum(e.num_stored for e in events if isinstance(e, KVOffloaded))
    assert stats["cpu_tier_stored_blocks"] == stored


def test_a_packed_layout_loads_with_one_descriptor_per_block():
    per_layer = evicted_then_reused()[1]
    packed = evicted_then_reused(kv_layout="packed")[1]
    a = next(e for e in per_layer if isinstance(e, KVLoaded))
    b = next(e for e in packed if isinstance(e, KVLoaded))
    assert a.num_tokens == b.num_tokens
    assert a.seconds - b.seconds == pytest.approx(a.num_tokens // 16 * 63 * DMA_DESCRIPTOR_S,
                                                  rel=1e-9)


def test_the_choice_between_load_and_recompute_follows_the_costs():
    # the same request on a host link 1000x slower: loading now loses to recomputing
    slow = dataclasses.replace(get_hardware("h200"), pcie_bandwidth=64e6)
    engine, events, again = evicted_then_reused(slow)
    declined = [e for e in events if isinstance(e, KVLoadDeclined)]
    assert not [e for e in events if isinstance(e, KVLoaded)]
    assert [e.request_id for e in declined] == ["again"]
    d = declined[0]
    assert d.load_s >= d.recompute_s
    assert again.num_offload_tokens == 0
    assert again.num_computed_prefill_tokens == again.num_prompt_tokens - again.num_cached_tokens

    fast_engine, fast_events, _ = evicted_then_reused()
    loaded = next(e for e in fast_events if isinstance(e, KVLoaded))
    assert loaded.seconds < fast_engine.prefill_seconds(loaded.num_tokens, 0)


def test_a_load_overlaps_other_work_and_the_gpu_waits_only_when_idle():
    def steps_during_load(with_company: bool):
        engine, events, _ = evicted_then_reused()
        engine.submit_prompt(list(range(60_000, 61_600)), 4)  # out of the GPU again
        engine.run_until()
        if with_company:
            engine.submit_prompt(list(range(90_000, 90_200)), 400, request_id="busy")
        t0 = engine.now
        engine.submit_prompt(PREFIX + list(range(200, 264)), 4, request_id="back",
                             at=t0 + 0.002)
        n_loads = sum(isinstance(e, KVLoaded) for e in events)
        engine.run_until()
        load = [e for e in events if isinstance(e, KVLoaded)][n_loads:]
        assert [e.request_id for e in load] == ["back"]
        start, end = load[0].t, load[0].t + load[0].seconds
        steps = engine.step_recorder.frame()
        ends = steps["start_s"] + steps["duration_s"]
        inside = steps[(steps["start_s"] < end - 1e-12) & (ends > start + 1e-12)]
        after = steps[steps["start_s"] >= end - 1e-12]
        return len(inside), after["start_s"].min() - end

    busy_steps, _ = steps_during_load(with_company=True)
    idle_steps, gap = steps_during_load(with_company=False)
    assert busy_steps > 0  # the other request decodes while the KV is on the wire
    assert idle_steps == 0 and abs(gap) < 1e-9  # alone, the next step starts as it lands


@pytest.mark.parametrize("load_s_vs_recompute", [0.5, 2.0])
def test_offer_compares_load_seconds_with_the_cost_models_recompute(load_s_vs_recompute):
    engine, _, _ = evicted_then_reused()
    store = engine.offload.stores[0]
    req = engine.submit_prompt(PREFIX + [1, 2, 3], 2, request_id="probe")
    bs = engine.block_size
    levels = store.locate(req.keys.keys(0, len(PREFIX) // bs).tolist())
    load_s = store.load_seconds(levels)
    engine.offload.prefill_seconds = lambda tokens, context: load_s / load_s_vs_recompute
    engine.offload._located.clear()
    offer = engine.offload.offer(req, 0, engine.now)
    if load_s_vs_recompute > 1:  # recomputing is quicker
        assert offer is None
    else:
        assert offer.tokens == len(levels) * bs and offer.seconds == load_s


def test_tiers_raise_prefix_hits_of_an_agentic_replay_and_are_deterministic():
    trace = small_agentx(6, seed=3)
    kw = dict(num_gpu_blocks_override=1300, block_size=16)
    base = Engine("llama-3.1-8b", "tp1", "h200", **kw).replay(
        trace, concurrency=6, loop_trace=False, progress=False)
    runs = [Engine("llama-3.1-8b", "tp1", "h200", cpu_kv_gib=16, **kw).replay(
        trace, concurrency=6, loop_trace=False, progress=False) for _ in range(2)]
    s = runs[0].summary
    assert s["kv_offload_loaded_tokens"] > 0
    assert s["prefix_cache_hit_rate"] > base.summary["prefix_cache_hit_rate"] + 0.1
    assert runs[0].requests["offload_tokens"].sum() == s["kv_offload_loaded_tokens"]
    wall = ("wall_s", "sim_speed")  # the only entries the host's speed may change
    assert {k: v for k, v in s.items() if k not in wall} == \
        {k: v for k, v in runs[1].summary.items() if k not in wall}
    assert runs[0].requests["first_token_s"].equals(runs[1].requests["first_token_s"])


def test_a_disk_tier_below_a_small_cpu_tier_keeps_what_the_cpu_evicts():
    trace = small_agentx(6, seed=3)
    kw = dict(num_gpu_blocks_override=1200, block_size=16)
    gib_per_block = 16 * 131072 / 2**30  # llama-3.1-8b bf16: 128 KiB per token
    r = Engine("llama-3.1-8b", "tp1", "h200", cpu_kv_gib=40 * gib_per_block,
               disk_kv_gib=1, **kw).replay(trace, concurrency=6, loop_trace=False, progress=False)
    s = r.summary
    assert s["cpu_tier_evicted_blocks"] > 0 and s["cpu_tier_dropped_blocks"] == 0
    assert s["disk_tier_stored_blocks"] == s["cpu_tier_evicted_blocks"]
    assert s["disk_tier_hit_blocks"] > 0
    assert s["cpu_tier_stored_blocks"] - s["cpu_tier_evicted_blocks"] <= 40


@pytest.mark.parametrize("knobs, message", [
    (dict(cpu_kv_gib=1e-6), "cannot hold one KV block"),
    (dict(cpu_kv_gib=10_000), "exceeds"),
    (dict(cpu_kv_gib=1, disk_kv_gib=1e-6), "cannot hold one KV block"),
    (dict(disk_kv_gib=10), "needs a CPU tier"),
    (dict(cpu_kv_gib=1, kv_offload_eviction="fifo"), "lru"),
    (dict(cpu_kv_gib=-1), ">= 0"),
])
def test_bad_tier_sizes_are_refused_before_anything_runs(knobs, message):
    with pytest.raises(ConfigError, match=message):
        Engine("llama-3.1-8b", "tp1", "h200", **knobs)


def test_a_hybrid_models_loaded_prefix_ends_where_a_state_snapshot_exists():
    """Kimi-Linear: KV blocks alone do not resume a sequence; a load from the tiers is
    cut back to the last block boundary whose linear-state snapshot is on the GPU, and
    the call resumes from that snapshot."""
    engine = Engine("kimi-linear-48b-a3b", "tp1", "h200", num_gpu_blocks_override=600,
                    cpu_kv_gib=64)
    snapshots = engine.schedulers[0].kv.snapshots
    resumed, loads = set(), []
    snapshots.on_restored = lambda key, rid, position: resumed.add((rid, position))
    engine.events.subscribe(
        lambda e: loads.append((e.request_id, engine.requests[e.request_id].num_computed_tokens)),
        KVLoaded)
    engine.replay(small_agentx(8), concurrency=8, duration_s=120)
    assert len(loads) > 5
    assert set(loads) <= resumed  # each load ends where a snapshot was taken


def test_a_sliding_window_models_load_brings_the_window_behind_the_prefix():
    """gpt-oss: window pages are written through like blocks; a loaded prefix ends where
    the tiers also hold the window behind it, and those pages come back with it."""
    def run(**knobs):
        engine = Engine("gpt-oss-120b", "tp2", "h200", num_gpu_blocks_override=2000, **knobs)
        window, loads = engine.schedulers[0].kv.window, []

        def check(e):  # the request now holds exactly the window at its prefix's end
            req = engine.requests[e.request_id]
            end = req.num_computed_tokens // engine.block_size
            pages = window.pages_of(e.request_id, max(0, end - window.hit_blocks), end)
            assert len(e.blocks) == e.num_tokens // engine.block_size + len(pages)
            assert set(pages.tolist()) <= set(e.blocks.tolist())
            loads.append(e)
        engine.events.subscribe(check, KVLoaded)
        summary = engine.replay(small_agentx(8), concurrency=8, duration_s=120).summary
        return summary, loads

    plain, _ = run()
    tiers, loads = run(cpu_kv_gib=64)
    assert len(loads) > 20
    assert tiers["prefix_cache_hit_rate"] > plain["prefix_cache_hit_rate"] + 0.3



SHARED_STORES = {
    # eight instances writing through to one host tier that fills: the order of the
    # writes decides what it evicts
    "dp8, a full tier": (dict(model="tiny-llama", layout="dp8", cpu_kv_gib=0.01),
                         dict(sessions=7, seed=219610, concurrency=8, start_part_way=True)),
    # a call whose prefix is on the other rank and in the tier: which source wins
    # depends on what the tier holds when the call is admitted
    "dp2, fetch or load": (dict(model="deepseek-v3", layout="dp2", router="round_robin",
                                long_prefill_token_threshold=1024,
                                num_gpu_blocks_override=300, cpu_kv_gib=0.1,
                                moe_routing="power_law_1.01"),
                           dict(sessions=11, seed=268383, concurrency=4,
                                start_part_way=False)),
    # lockstep ranks: a prefix copied from another rank lands on one as the step that
    # takes it in starts, at the float time the others' last step ended — step by step
    # writes those ends first (the instance commits, then plans), the landed prefix after
    "dep8, a copied prefix lands as steps end": (
        dict(model="qwen3-30b-a3b", layout="dep8", cpu_kv_gib=2.0, disk_kv_gib=0.05),
        dict(sessions=6, seed=331396, block_size=64, concurrency=16, start_part_way=True,
             duration_s=10)),
}


@pytest.mark.parametrize("name", list(SHARED_STORES))
def test_instances_sharing_a_node_store_see_it_as_step_by_step_does(name):
    """Independent instances sharing a node's store: step by step writes their blocks
    through in time order and reads what was written before; fast-forwarded runs play
    late, so their writes wait, and a read first plays the sharing ranks up to its
    time and applies the writes in time order (`offload.py`), those of steps ending
    before those of steps starting. Tables, summary and the write-through events then
    agree with step by step, bit for bit."""
    knobs, load = SHARED_STORES[name]
    load = dict(load)  # (the table is the module's: a rerun must find it whole)
    trace = small_agentx(load.pop("sessions"), seed=load.pop("seed"),
                         block_size=load.pop("block_size", 16))
    runs, logs = [], []
    for ff in (False, True):
        engine = Engine(hardware="h200", sim_fast_forward=ff, **knobs)
        log = []
        engine.events.subscribe(lambda e, log=log: log.append(
            (e.t, e.store, e.num_stored, e.num_demoted, e.num_dropped)), KVOffloaded)
        runs.append(engine.replay(trace, max_idle_s=2.0, **{"duration_s": 60, **load}))
        logs.append(log)
    step, ff = runs
    assert step.summary["cpu_tier_evicted_blocks"] > 1000  # the tier is full: order matters
    assert logs[1] == logs[0] and [t for t, *_ in logs[1]] == sorted(t for t, *_ in logs[1])

    def summary(result):  # as JSON, where NaN equals NaN (no session ended)
        return json.dumps({k: v for k, v in result.summary.items()
                           if k not in ("wall_s", "sim_speed")}, default=str)
    assert summary(ff) == summary(step)
    assert ff.steps.equals(step.steps) and ff.requests.equals(step.requests)
