"""Widget logic without a browser: what each view would draw matches what the engine did."""

import numpy as np
import pytest

from labkit import Engine
from labkit.widgets import BlockTableView, LockstepView, PrefixCacheView, RankKVView
from labkit.widgets.block_table import STATES, aggregate
from support import small_agentx


def engine_with_views(**kw):
    kw.setdefault("model", "qwen3-30b-a3b")
    kw.setdefault("layout", "dep2")
    engine = Engine(hardware="h200", max_model_len=1 << 20, **kw)
    views = {"blocks0": BlockTableView(engine, rank=0), "blocks1": BlockTableView(engine, rank=1),
             "prefix": PrefixCacheView(engine), "lockstep": LockstepView(engine),
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
        data = views[f"blocks{rank}"].figure_data()
        assert data["blocks_in_use"] == int((kv.pool.ref_count > 0).sum())
        assert data["shared_blocks"] == int((kv.pool.ref_count > 1).sum())
        assert data["cached_free_blocks"] == int(((kv.pool.ref_count == 0)
                                                  & (kv.pool.block_key >= 0)).sum())
        assert sorted(data["requests"]) == sorted(live)  # every table, none cut off
        for rid, row, refs_row, states in zip(data["requests"], data["blocks"], data["refs"],
                                              data["state"]):
            assert row == live[rid]
            assert refs_row == [int(kv.pool.ref_count[b]) for b in row]
            for block, state in zip(row, states):
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


@pytest.mark.parametrize("layout", ["dep2", "dp2"])
def test_fast_forwarded_runs_replay_step_by_step(layout):
    """With fast-forward on, whole runs of steps arrive at once, yet the tables shown
    after each step of a rank's instance equal those of a step-by-step engine after
    that same step. (dp2: two instances step independently; a step number counts
    steps in the order they are reported, so compare each instance's own steps.)"""
    trace = small_agentx(6, seed=3)
    per_step = {}
    for ff in (False, True):
        engine = Engine("qwen3-30b-a3b", layout, "h200", max_model_len=1 << 20,
                        sim_fast_forward=ff)
        models = [BlockTableView(engine, rank=r).model for r in (0, 1)]
        engine.start_replay(trace, concurrency=4, duration_s=40, start_part_way=False)
        live = {}
        while engine.step():
            live[models[0].steps_done] = [{k: list(t) for k, t in m.live.tables.items()}
                                          for m in models]
        tables = {}
        for rank, model in enumerate(models):
            seqs = model.clock.seqs[model.clock.instance_of_rank[rank]]
            for j, seq in enumerate(seqs):
                shown = live[seq][rank] if not ff else \
                    {k: list(t) for k, t in model.state_at(seq).tables.items()}
                tables[rank, j] = shown
        per_step[ff] = tables
    assert len(per_step[False]) > 1000 and sum(map(bool, per_step[False].values())) > 500
    assert per_step[True] == per_step[False]


def naive_binning(rows, edges, rank):
    """Per bin: seconds of work and of stall of one rank, by direct interval overlap."""
    busy, stall = np.zeros(len(edges) - 1), np.zeros(len(edges) - 1)
    for r in rows[rows["rank"] == rank].itertuples():
        work = (r.start_s, r.start_s + r.busy_s)
        wait = (r.start_s + r.busy_s, r.start_s + r.duration_s)
        for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
            busy[i] += max(0.0, min(hi, work[1]) - max(lo, work[0]))
            stall[i] += max(0.0, min(hi, wait[1]) - max(lo, wait[0]))
    return busy, stall


def test_lockstep_and_kv_views_match_the_steps_table():
    engine, views = engine_with_views()
    result = engine.replay(small_agentx(5, seed=4), concurrency=4, duration_s=20)
    steps = result.steps.sort_values(["start_s", "rank"], ignore_index=True)
    model = views["lockstep"].model
    frame = model.frame().sort_values(["start_s", "rank"], ignore_index=True)
    assert len(frame) == len(steps) and model.ranks == [0, 1]
    for col in ("start_s", "duration_s", "busy_s", "comm_s", "stall_s", "prefill_tokens",
                "decode_tokens"):
        assert np.allclose(frame[col], steps[col]), col
    overhead = steps["busy_s"] - steps["compute_s"] - steps["comm_s"]
    assert np.allclose(frame["compute_s"], steps["compute_s"] + overhead)
    # the heatmap's bins, against interval overlaps summed by hand
    data = views["lockstep"].figure_data()
    assert data["steps"] == steps["step"].nunique() > 100
    sample = steps[steps["start_s"] < 1.0]
    grid = model.binned(window=(0.0, 1.0), bins=7)
    for i, rank in enumerate((0, 1)):
        busy, stall = naive_binning(sample, grid["edges"], rank)
        assert np.allclose(grid["busy_s"][i], busy) and np.allclose(grid["stall_s"][i], stall)
        stepping = busy + stall
        share = grid["stall_share"][i]
        assert np.allclose(share[stepping > 0], 100 * stall[stepping > 0] / stepping[stepping > 0])
        assert np.isnan(share[stepping == 0]).all()
    assert data["stall_s"].sum() == pytest.approx(steps["stall_s"].sum())
    # KV per GPU: every GPU of a DP rank shows that rank's bytes per GPU
    kv = views["kv"].figure_data()
    assert kv["gpu"] == [0, 1] and kv["dp_rank"] == [0, 1]  # dep2: one GPU per rank
    for gpu, rank in zip(kv["gpu"], kv["dp_rank"]):
        final = steps[steps["rank"] == rank].iloc[-1]
        assert kv["persistent"][gpu] == final["persistent_kv_bytes"]
        assert kv["temporary"][gpu] == final["temporary_kv_bytes"]
        assert kv["capacity"][gpu] == pytest.approx(
            engine.num_blocks_per_rank * engine.instances[0].kv_bytes_per_block)


def test_kv_view_has_a_bar_per_gpu_and_a_scale_that_shows_them():
    """tp2 and tp4xdcp2 on an MLA model: 2 GPUs each with every token's latent, vs 4
    GPUs each with half the tokens. Tiny-DeepSeek's latent: (32 + 8) bf16 values per
    token and layer, 3 layers = 240 bytes per token, on every GPU that holds it."""
    for layout, gpus, dcp in (("tp2", 2, 1), ("tp4xdcp2", 4, 2)):
        engine = Engine("tiny-deepseek-v3", layout, "h200", max_model_len=1 << 16,
                        num_gpu_blocks_override=1 << 20)  # 3.75 GiB of KV per GPU
        view = RankKVView(engine)
        steps = engine.replay(small_agentx(3, seed=1), concurrency=2, duration_s=1,
                              start_part_way=False).steps
        busiest = steps.loc[steps["kv_used_blocks"].idxmax()]
        seq = int(busiest["step"]) + 1  # one instance: steps are numbered from 1
        view.show_step(seq)
        data = view.figure_data(seq)
        assert data["gpu"] == list(range(gpus)) and len(set(data["persistent"])) == 1
        assert data["persistent"][0] == busiest["kv_used_blocks"] * 16 * 240 / dcp
        top = view.figure.layout.yaxis.range[1]  # the scale follows the data
        assert max(data["persistent"]) / (1 << 30) <= top <= 1.0 < data["capacity"][0] / (1 << 30)
        assert view.figure.layout.yaxis2.range[1] == pytest.approx(
            100 * top / (data["capacity"][0] / (1 << 30)))


def test_prefix_cache_view_hit_rate_is_the_summary_s():
    engine, views = engine_with_views(model="tiny-llama", layout="dp2",
                                      router="session_sticky", num_gpu_blocks_override=1 << 14)
    result = engine.replay(small_agentx(5, seed=5), concurrency=4, duration_s=30)
    data = views["prefix"].figure_data()
    assert data["hit_rate"][-1] == pytest.approx(result.summary["prefix_cache_hit_rate"])
    req = result.requests.set_index("request_id")
    for rid, cached, computed in zip(data["requests"], data["cached"], data["computed"]):
        assert cached == req.loc[rid, "cached_tokens"]
        assert cached + computed == req.loc[rid, "input_tokens"]


def test_redraws_are_throttled():
    engine = Engine("tiny-llama", "tp1", "h200", block_size=16, num_gpu_blocks_override=4096)
    view = LockstepView(engine, bins=50)
    view.min_interval_s = 1e9  # never due: only explicit draws
    engine.replay(small_agentx(3, seed=1), concurrency=2, duration_s=10)
    assert view.redraws == 1 and view.model.steps_done > 100
    view.flush()
    assert view.redraws == 2
    assert len(view.figure.data[0].x) == 50


def test_wide_tables_are_aggregated_and_say_so():
    codes = [[STATES["prefix hit"]] * 900 + [STATES["computed"]] * 100,
             [STATES["forked"]] * 10]
    refs = [[1] * 1000, [2] * 10]
    grid = aggregate(codes, refs, 0, 1000, columns=200)
    assert grid["blocks_per_column"] == 5 and len(grid["starts"]) == 200
    assert grid["cells"][0][0] == STATES["prefix hit"] and grid["cells"][0][-1] == \
        STATES["computed"]
    assert grid["cells"][1][:2] == [STATES["forked"]] * 2
    assert grid["cells"][1][2:] == [STATES["empty"]] * 198
    assert grid["hover"][0][0] == "blocks 0-4: 5 prefix hit; max refs 1"
    zoomed = aggregate(codes, refs, 890, 910, columns=200)  # zoomed in: block by block
    assert zoomed["blocks_per_column"] == 1 and zoomed["starts"] == list(range(890, 910))


def test_block_table_pages_and_empty_state():
    engine = Engine("tiny-llama", "tp1", "h200", block_size=16, num_gpu_blocks_override=256,
                    sim_fast_forward=False)
    view = BlockTableView(engine, rows=2)
    assert view.figure_data()["requests"] == []
    assert view.figure.layout.annotations[0].text.startswith("no request holds KV")
    assert view.figure.layout.xaxis.visible is False
    for i in range(5):
        engine.submit_prompt(list(range(100 * i, 100 * i + 40)), 30, request_id=f"r{i}")
    for _ in range(3):
        engine.step()
    view.show_page(2)
    data = view.figure_data()
    assert len(data["requests"]) == 5 and data["pages"] == 3 and data["shown"] == ["r4"]
    assert "requests 5-5 of 5 (page 3/3)" in view.figure.layout.title.text
    assert not view.figure.layout.annotations and view.figure.layout.xaxis.visible


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
    data = view.figure_data()
    row = data["requests"].index("again")
    cells = dict(zip(data["blocks"][row], data["state"][row]))
    load = loads[0]
    assert set(load.block_tiers) == {"cpu", "disk"}  # a small CPU tier spilled to disk
    for block, tier in zip(load.blocks.tolist(), load.block_tiers):
        assert cells[block] == STATES[tier]
    others = set(cells) - set(load.blocks.tolist())
    assert all(cells[b] not in (STATES["cpu"], STATES["disk"]) for b in others)


def test_forks_and_copy_on_write_are_coloured():
    """A subagent forks from its parent mid-block: it shares the parent's blocks
    (forked), and its first write into the shared partial block makes a copy."""
    from labkit.engine.events import CopyOnWrite, Forked

    engine = Engine("qwen3-30b-a3b", "tp1", "h200", max_model_len=1 << 20)
    view = BlockTableView(engine)
    seen = {"fork": [], "cow": []}
    engine.events.subscribe(seen["fork"].append, Forked)
    engine.events.subscribe(seen["cow"].append, CopyOnWrite)
    engine.replay(small_agentx(6, seed=3), concurrency=4, duration_s=30,
                  start_part_way=False)
    assert seen["fork"] and seen["cow"]
    model = view.model
    cow = seen["cow"][0]
    step = next(s for s in range(1, model.steps_done + 1)
                if cow.request_id in model.state_at(s).tables
                and cow.dst_block in model.state_at(s).tables[cow.request_id])
    data = view.figure_data(step)
    row = data["requests"].index(cow.request_id)
    cells = dict(zip(data["blocks"][row], data["state"][row]))
    assert cells[cow.dst_block] == STATES["copied"]
    assert STATES["forked"] in cells.values()
