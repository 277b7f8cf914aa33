"""KVPlacementView.placement() against closed forms, layout by layout.

Every expectation is written out from the layout's definition (GPU numbering
`((dp * pp + stage) * pcp + pcp_index) * tp + tp_index`, DCP's `(p // I) % dcp`, GQA's
head split, PCP's 2N chunks) and compared with the positions the rows cover, expanded
by brute force over every position.
"""

import numpy as np
import pytest

from labkit import Engine
from labkit.engine.events import StepsCompleted
from labkit.engine.request import Request
from labkit.widgets import KVPlacementView

DSV3, L70, L8 = "deepseek-v3", "llama-3.1-70b", "llama-3.1-8b"


def run(model, layout, prompts=(3000,), steps=3, output=64, **knobs):
    """An engine with a placement view, `prompts` submitted at 0, `steps` steps run
    (one by one: fast-forward has its own test)."""
    knobs.setdefault("max_model_len", 1 << 20)
    knobs.setdefault("sim_fast_forward", False)
    engine = Engine(model=model, layout=layout, hardware="h200", **knobs)
    view = KVPlacementView(engine)
    for i, n in enumerate(prompts):
        engine.submit(Request(f"r{i}", f"s{i}", n, output, 0.0), at=0.0)
    for _ in range(steps):
        assert engine.step()
    return engine, view


def positions(frame, gpu, rid, kind="persistent") -> set[int]:
    """Every position the rows say `gpu` holds of request `rid` (brute force)."""
    out = set()
    rows = frame[(frame.gpu == gpu) & (frame.request_id == rid) & (frame.kind == kind)]
    for row in rows.itertuples():
        out.update(p for p in range(row.start, row.end)
                   if (p // row.interleave) % row.shards == row.shard)
    return out


def indices(frame, gpu, column, kind="persistent") -> set[int]:
    rows = frame[(frame.gpu == gpu) & (frame.kind == kind)]
    return {i for value in rows[column] for i in value.range}


def held(engine, rid) -> int:
    return engine.requests[rid].num_computed_tokens


# ------------------------------------------------------------------------- TP
@pytest.mark.parametrize("model,layout,heads_of", [
    (L70, "tp4", lambda t: {2 * t, 2 * t + 1}),   # 8 KV heads split 4 ways
    (L70, "tp16", lambda t: {t // 2}),            # past tp = kv_heads: each head on 2 GPUs
    (DSV3, "tp8", lambda t: {0}),                 # MLA: one latent, replicated
])
def test_tp_replicas_hold_every_position_and_their_heads(model, layout, heads_of):
    engine, view = run(model, layout)
    frame = view.placement()
    n, layers = held(engine, "r0"), engine.model.num_layers
    assert n > 3000
    for gpu in range(engine.layout.gpus):
        assert positions(frame, gpu, "r0") == set(range(n))
        assert indices(frame, gpu, "heads") == heads_of(gpu)
        assert indices(frame, gpu, "layers") == set(range(layers))
    assert not (frame.kind == "temporary").any()


# ------------------------------------------------------------------------ DCP
@pytest.mark.parametrize("interleave", [1, 16])
def test_dcp_shards_positions_by_interleave(interleave):
    engine, view = run(DSV3, "tp8xdcp8", prompts=(1000,), dcp_kv_cache_interleave_size=interleave)
    frame = view.placement()
    n = held(engine, "r0")
    shards = [positions(frame, gpu, "r0") for gpu in range(8)]
    for gpu, mine in enumerate(shards):  # MLA: the eight TP GPUs are one DCP group
        assert mine == {p for p in range(n) if (p // interleave) % 8 == gpu}
    assert set.union(*shards) == set(range(n)) and sum(map(len, shards)) == n


def test_dcp_on_gqa_shards_the_replicas_of_each_head():
    engine, view = run(L70, "tp16xdcp2", prompts=(777,), dcp_kv_cache_interleave_size=8)
    frame = view.placement()
    n = held(engine, "r0")
    for gpu in range(16):  # head gpu // 2 lives on GPUs 2h, 2h+1: they shard it
        assert indices(frame, gpu, "heads") == {gpu // 2}
        assert positions(frame, gpu, "r0") == {p for p in range(n) if (p // 8) % 2 == gpu % 2}


def test_toggling_dcp_changes_only_what_each_gpu_holds():
    tp, view_tp = run(DSV3, "tp8", prompts=(2048,))
    dcp, view_dcp = run(DSV3, "tp8xdcp8", prompts=(2048,))
    n = held(tp, "r0")
    assert n == held(dcp, "r0")
    for gpu in range(8):
        assert len(positions(view_tp.placement(), gpu, "r0")) == n
        assert len(positions(view_dcp.placement(), gpu, "r0")) == n // 8 + (gpu < n % 8)


# ------------------------------------------------------------------------ PCP
def test_pcp_splits_queries_into_paired_chunks_and_keeps_all_kv():
    engine, view = run(DSV3, "pcp8xep8", prompts=(32,), steps=1)
    queries = view.queries(step=1)
    frame = view.placement(step=1)
    for gpu in range(8):
        mine = {p for row in queries[queries.gpu == gpu].itertuples()
                for p in range(row.start, row.end)}
        # 32 prompt tokens in 2 * 8 chunks of 2: rank r takes chunks r and 15 - r
        assert mine == {2 * gpu, 2 * gpu + 1, 30 - 2 * gpu, 31 - 2 * gpu}
        # the new KV is all-gathered: every PCP rank keeps all of it
        assert positions(frame, gpu, "r0") == set(range(32))


def temporary_bytes(engine):
    """Per step, the temporary KV bytes per GPU the step model reports (rank 0)."""
    out = []
    engine.events.subscribe(lambda e: out.extend(e.temporary_kv_bytes[:, 0].tolist()),
                            StepsCompleted)
    return out


@pytest.mark.parametrize("layout,gathered", [
    ("pcp8xdcp8xep8", lambda ctx, new: ctx + new),  # PCPxDCP: the full KV, for its queries
    ("tp8xdcp8", lambda ctx, new: ctx),             # DCP on MLA: a prefill's cached prefix
])
def test_prefill_gathers_a_temporary_full_copy(layout, gathered):
    engine = Engine(model=DSV3, layout=layout, hardware="h200", max_num_batched_tokens=1024)
    view = KVPlacementView(engine)
    reported = temporary_bytes(engine)
    engine.submit(Request("r0", "s0", 3000, 4, 0.0), at=0.0)
    per_token = engine.placement.kv_bytes_per_token_per_layer_per_gpu()
    for step in (1, 2):
        engine.step()
        frame = view.placement(step=step)
        ctx = (step - 1) * 1024
        for gpu in range(8):  # persistent: the GPU's shard of the prefix computed so far
            assert positions(frame, gpu, "r0") == {p for p in range(ctx + 1024)
                                                   if p % 8 == gpu}
            assert positions(frame, gpu, "r0", "temporary") == set(range(gathered(ctx, 1024)))
        assert reported[step - 1] == pytest.approx(gathered(ctx, 1024) * per_token)
    while engine.requests["r0"].num_output_tokens < 2:
        engine.step()
    assert not (view.placement().kind == "temporary").any()  # decode gathers nothing


# ----------------------------------------------------------------- KVPP and PP
def test_kvpp_layer_owners_and_broadcast_layers():
    engine, view = run(DSV3, "tp8xkvpp8", prompts=(500,))
    reported = temporary_bytes(engine)
    engine.step()
    frame = view.placement()
    n, layers = held(engine, "r0"), set(range(61))
    ctx = n - 1  # a decode step: one new token after ctx
    for gpu in range(8):
        owned = {layer for layer in layers if layer % 8 == gpu}
        assert indices(frame, gpu, "layers") == owned
        assert indices(frame, gpu, "layers", "temporary") == layers - owned
        assert positions(frame, gpu, "r0") == set(range(n))
        assert positions(frame, gpu, "r0", "temporary") == set(range(ctx + 1))
    per_token = engine.placement.kv_bytes_per_token_per_layer_per_gpu()
    assert reported[-1] == pytest.approx((ctx + 1) * per_token)


def test_pp_stages_hold_their_layers():
    engine, view = run(DSV3, "tp8xpp2")
    frame = view.placement()
    # 61 layers over 2 stages: the first (GPUs 0-7) takes the extra one
    for gpu in range(16):
        layers = range(0, 31) if gpu < 8 else range(31, 61)
        assert indices(frame, gpu, "layers") == set(layers)
        assert positions(frame, gpu, "r0") == set(range(held(engine, "r0")))


# ------------------------------------------------------------------ DP and DEP
@pytest.mark.parametrize("model,layout,gpus_of", [
    (L8, "dp2xtp2", lambda rank: {2 * rank, 2 * rank + 1}),
    (DSV3, "dep8", lambda rank: {rank}),
])
def test_requests_live_on_their_own_rank_only(model, layout, gpus_of):
    engine, view = run(model, layout, prompts=(900, 1300, 700, 1100), steps=4)
    frame = view.placement()
    ranks = set()
    for rid in ("r0", "r1", "r2", "r3"):
        rank = engine.requests[rid].rank
        ranks.add(rank)
        assert set(frame[frame.request_id == rid].gpu) == gpus_of(rank)
        assert (frame[frame.request_id == rid].dp_rank == rank).all()
        for gpu in gpus_of(rank):
            assert positions(frame, gpu, rid) == set(range(held(engine, rid)))
    assert len(ranks) > 1


# ---------------------------------------------------------------- compactness
def test_rows_are_runs_of_one_source():
    engine, view = run(DSV3, "tp8xdcp8", prompts=(3000, 200), steps=5)
    frame = view.placement()
    for _, rows in frame.groupby(["gpu", "request_id", "kind"]):
        starts, ends = rows.start.to_numpy(), rows.end.to_numpy()
        assert (starts[1:] == ends[:-1]).all()  # contiguous, in order
        assert (rows.source.to_numpy()[1:] != rows.source.to_numpy()[:-1]).all()
    assert len(frame) == 8 * 2  # one source each (computed), 8 GPUs, 2 requests


def test_figure_bins_a_million_tokens_without_losing_any():
    engine = Engine(model=DSV3, layout="tp8xdcp8", hardware="h200", max_model_len=1 << 21,
                    max_num_batched_tokens=1 << 17)
    view = KVPlacementView(engine, max_cells=400)
    engine.submit(Request("long", "s0", 1_000_000, 4, 0.0), at=0.0)
    engine.submit(Request("short", "s1", 3000, 4, 0.0), at=0.0)
    while engine.requests["long"].num_output_tokens < 1:
        engine.step()
    data = view.figure_data()
    n = data["cell_tokens"]
    assert n & (n - 1) == 0 and data["z"].shape[1] <= 400 + 2
    assert data["requests"] == ["long", "short"] and data["request_cells"]["short"] >= 1
    size = np.concatenate([np.minimum(n, data["lengths"][r] - n * np.arange(c))
                           for r, c in data["request_cells"].items()])
    for gpu in range(8):  # shares x cell sizes add up to what the GPU holds
        band = data["bands"][(gpu, "persistent")]
        assert round(float((data["share"][band] * size).sum())) == data["held_tokens"][gpu]
        expected = sum(len(range(gpu, held(engine, r), 8)) for r in ("long", "short"))
        assert data["held_tokens"][gpu] == expected


@pytest.mark.parametrize("model,layout,copies", [
    (DSV3, "tp8", 8), (DSV3, "tp8xdcp8", 1), (DSV3, "pcp8xep8", 8),
    (DSV3, "pcp8xdcp8xep8", 1), (DSV3, "dep8", 1), (DSV3, "tp8xkvpp8", 1),
    (DSV3, "tp8xpp2", 8), (L70, "tp8", 1), (L70, "tp16", 2), (L70, "tp16xdcp2", 1),
])
def test_kv_shares_add_up_to_the_layouts_copies(model, layout, copies):
    engine, view = run(model, layout, prompts=(1001, 3333))
    gpus = view.per_gpu()
    per_rank = gpus.groupby("dp_rank").kv_share.sum()
    busy = per_rank[gpus.groupby("dp_rank").requests.max() > 0]
    assert len(busy) and busy.to_numpy() == pytest.approx(copies)
    if "pp" not in layout and "kvpp" not in layout:  # where the layout's own sum is exact
        assert engine.placement.kv_replication() == pytest.approx(copies)


@pytest.mark.parametrize("interleave", [1, 16])
def test_zoom_shows_the_dcp_interleave_token_by_token(interleave):
    engine, view = run(DSV3, "tp8xdcp8", prompts=(3000, 500),
                       dcp_kv_cache_interleave_size=interleave)
    view.zoom(1000, 1256, request_id="r0")
    data = view.figure_data()
    assert data["cell_tokens"] == 1 and data["requests"] == ["r0"]
    positions = np.arange(1000, 1256)
    for gpu in range(8):
        share = data["share"][data["bands"][(gpu, "persistent")]]
        assert (share == ((positions // interleave) % 8 == gpu)).all()
    view.zoom()
    assert view.figure_data()["requests"] == ["r0", "r1"]


def test_live_figure_carries_no_nan():
    """NaN is not JSON: a widget message carrying one is dropped (the figure would never
    update). Empty cells are drawn white instead."""
    engine, view = run(DSV3, "dep8", prompts=(900, 1300))
    view.flush()
    z = np.asarray(view.figure.data[0].z)
    assert np.isfinite(z).all() and (z == 0.5).any()  # the ranks without requests
    assert view.figure.layout.xaxis.title.text.endswith("(1 cell = 8 tokens)")


@pytest.mark.parametrize("model,layout,share_of", [
    (L70, "tp8", lambda gpu: 1 / 8),                       # one KV head of 8
    (L70, "tp4", lambda gpu: 2 / 8),                       # two of 8
    (DSV3, "tp8xpp2", lambda gpu: (31 if gpu < 8 else 30) / 61),  # its stage's layers
    (DSV3, "tp8", lambda gpu: 1.0),                        # MLA: the whole latent
])
def test_shade_is_the_share_of_each_tokens_kv_a_gpu_keeps(model, layout, share_of):
    engine, view = run(model, layout, prompts=(4096,))
    data = view.figure_data()
    for gpu in range(engine.layout.gpus):
        share = data["share"][data["bands"][(gpu, "persistent")]]
        full = share[:-1]  # every cell but the last, partly filled one
        assert full == pytest.approx(np.full(len(full), share_of(gpu)))
