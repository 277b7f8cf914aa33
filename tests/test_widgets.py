"""Widget logic without a browser: what each view would draw matches what the engine did."""

import numpy as np
import pytest

from labkit import Engine
from labkit.widgets import (
    BlockTableView, Dashboard, LockstepView, PrefixCacheView, RankKVView, layout_string,
)
from labkit.widgets.block_table import STATES
from support import small_agentx


def engine_with_views(**kw):
    kw.setdefault("model", "qwen3-30b-a3b")
    kw.setdefault("layout", "dep2")
    engine = Engine(hardware="h200", max_model_len=1 << 20, **kw)
    views = {"blocks0": BlockTableView(engine, rank=0), "blocks1": BlockTableView(engine, rank=1),
             "prefix": PrefixCacheView(engine), "lockstep": LockstepView(engine, last=40),
             "kv": RankKVView(engine)}
    return engine, views


def run_until_busy(engine, trace):
    """Step until both ranks hold running requests (and some history exists)."""
    engine.start_replay(trace, concurrency=4, duration_s=120, start_part_way=False)
    steps = 0
    while engine.step():
        steps += 1
        if steps > 30 and all(s.running for s in engine.schedulers):
            return
    raise AssertionError("never saw both ranks busy")


def test_block_tables_rebuilt_from_events_match_the_kv_manager():
    engine, views = engine_with_views()
    run_until_busy(engine, small_agentx(6, seed=3))
    for rank in (0, 1):
        model = views[f"blocks{rank}"].model
        kv = engine.schedulers[rank].kv
        live = {rid: t.view().tolist() for rid, t in kv.tables.items()}
        assert model.live.tables == live
        assert len(live) > 0
        refs = model.live.ref_counts()
        for block, count in refs.items():
            assert kv.pool.ref_count[block] == count
        keyed = set(np.flatnonzero(kv.pool.block_key >= 0).tolist())
        assert model.live.keyed == keyed
        grid = views[f"blocks{rank}"].figure_data()
        assert grid["blocks_in_use"] == int((kv.pool.ref_count > 0).sum())
        assert grid["cached_free_blocks"] == int(((kv.pool.ref_count == 0)
                                                  & (kv.pool.block_key >= 0)).sum())
        for rid, row, states in zip(grid["requests"], grid["blocks"], grid["state"]):
            table = live[rid]
            assert row[:len(table)] == table
            for block, state in zip(table, states):
                if kv.pool.ref_count[block] > 1 and state != STATES["forked"]:
                    assert state == STATES["shared"]


def test_block_table_replay_shows_the_state_at_an_earlier_step():
    engine, views = engine_with_views(sim_fast_forward=False)
    engine.start_replay(small_agentx(6, seed=3), concurrency=4, duration_s=60,
                        start_part_way=False)
    model = views["blocks0"].model
    snapshots = {}
    while engine.step() and len(snapshots) < 120:
        snapshots[model.steps_done] = {k: list(v) for k, v in model.live.tables.items()}
    assert sum(bool(tables) for tables in snapshots.values()) > 20
    for step in list(snapshots)[::7]:
        assert model.state_at(step).tables == snapshots[step]


def test_lockstep_and_kv_views_match_the_steps_table():
    engine, views = engine_with_views()
    result = engine.replay(small_agentx(5, seed=4), concurrency=4, duration_s=20)
    steps = result.steps
    data = views["lockstep"].figure_data()
    assert len(data["steps"]) == 40 and data["ranks"] == [0, 1]
    last = steps.sort_values(["start_s", "rank"]).tail(80)  # 40 steps x 2 ranks
    overhead = last["busy_s"] - last["compute_s"] - last["comm_s"]
    for rank in (0, 1):
        rows = last[last["rank"] == rank]
        assert np.allclose(data["stall"][rank], rows["stall_s"])
        assert np.allclose(data["comm"][rank], rows["comm_s"])
        assert np.allclose(data["compute"][rank], rows["compute_s"] + overhead[rows.index])
    kv = views["kv"].figure_data()
    for rank in (0, 1):
        final = steps[steps["rank"] == rank].iloc[-1]
        assert kv[rank]["persistent"] == final["persistent_kv_bytes"]
        assert kv[rank]["temporary"] == final["temporary_kv_bytes"]
        assert kv[rank]["capacity"] == pytest.approx(
            engine.num_blocks_per_rank * engine.instances[0].kv_bytes_per_block)


def test_prefix_cache_view_hit_rate_is_the_summary_s():
    engine, views = engine_with_views(model="tiny-llama", layout="dp2",
                                      router="session_sticky")
    result = engine.replay(small_agentx(5, seed=5), concurrency=4, duration_s=30)
    data = views["prefix"].figure_data()
    assert data["hit_rate"][-1] == pytest.approx(result.summary["prefix_cache_hit_rate"])
    req = result.requests.set_index("request_id")
    for rid, cached, computed in zip(data["requests"], data["cached"], data["computed"]):
        assert cached == req.loc[rid, "cached_tokens"]
        assert cached + computed == req.loc[rid, "input_tokens"]


def test_redraws_are_throttled():
    engine = Engine("tiny-llama", "tp1", "h200", block_size=16)
    view = LockstepView(engine)
    view.min_interval_s = 1e9  # never due: only explicit draws
    engine.replay(small_agentx(3, seed=1), concurrency=2, duration_s=10)
    assert view.redraws == 1 and view.model.steps_done > 100
    view.flush()
    assert view.redraws == 2
    assert len(view.figure.data[0].x) == 50


def test_dashboard_rebuilds_steps_and_replays():
    dash = Dashboard(small_agentx(4, seed=2), model="qwen3-30b-a3b", layout="dep2",
                     hardware="h200", concurrency=3, duration_s=60, max_model_len=1 << 20)
    assert dash.step(30)
    first = dash.engine
    dash.run()
    assert dash.slider.max == dash.views["lockstep"].model.steps_done > 30
    dash.slider.value = 10  # the slider replays every view at step 10
    assert dash.views["lockstep"].shown_step == 10
    assert dash.views["lockstep"].figure_data(10)["steps"][-1] == 10
    dash.layout_text.value = "tp9"  # impossible: says so, keeps the old engine
    dash.rebuild()
    assert dash.engine is first and "cannot build" in dash.status.value
    dash.kind.value, dash.degree.value = "TP", 4
    assert dash.layout_text.value == "tp4"
    dash.kind.value = "DEP"
    dash.rebuild()
    assert dash.engine is not first and dash.engine.layout.text == "dep4"
    assert dash.slider.max == 0  # a fresh run


@pytest.mark.parametrize("kind,degree,moe,expected", [
    ("TP", 8, False, "tp8"), ("DCP", 8, True, "tp8xdcp8"), ("PCP", 4, True, "pcp4xdcp4xep4"),
    ("PCP", 4, False, "pcp4xdcp4"), ("DEP", 16, True, "dep16"), ("DP", 2, False, "dp2"),
    ("DEP", 1, True, "tp1")])
def test_layout_choices(kind, degree, moe, expected):
    assert layout_string(kind, degree, moe) == expected


def test_block_table_colours_blocks_loaded_from_the_offload_tiers():
    engine = Engine("llama-3.1-8b", "tp1", "h200", num_gpu_blocks_override=160,
                    cpu_kv_gib=0.25, disk_kv_gib=1)  # CPU: 128 blocks of 2 MiB
    view = BlockTableView(engine, rank=0)
    from labkit.engine.events import KVLoaded

    loads = []
    engine.events.subscribe(loads.append, KVLoaded)
    engine.submit_prompt(list(range(1000, 3048)), 4, request_id="first")
    engine.run_until()
    engine.submit_prompt(list(range(50_000, 51_600)), 4, request_id="other")
    engine.run_until()
    engine.submit_prompt(list(range(1000, 3048)) + list(range(7, 71)), 4, request_id="again")
    while not loads:
        assert engine.step()
    grid = view.figure_data()
    row = grid["requests"].index("again")
    cells = dict(zip(grid["blocks"][row], grid["state"][row]))
    load = loads[0]
    assert set(load.block_tiers) == {"cpu", "disk"}  # a small CPU tier spilled to disk
    for block, tier in zip(load.blocks.tolist(), load.block_tiers):
        assert cells[block] == STATES[tier]
    others = set(cells) - set(load.blocks.tolist()) - {-1}
    assert all(cells[b] not in (STATES["cpu"], STATES["disk"]) for b in others)
