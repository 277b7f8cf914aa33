"""The placement view against the compute plane's real per-GPU paged caches.

The strongest check there is: a tiny model runs on real tensors, and for every GPU and
every request the positions whose KV entries are nonzero in that GPU's cache are
exactly those `placement()` says the GPU holds; under TP each GPU's KV heads are the
slice of a single-GPU run's heads that the rows name.
"""

import numpy as np
import pytest
import torch

from labkit import Engine
from labkit.widgets import KVPlacementView

pytest.importorskip("torch")


def compute_run(model, layout, **knobs):
    """Two prompts sharing two blocks of prefix, stepped on real tensors: the second
    arrives once the first is prefilled (and hits the prefix cache), then both decode
    a few steps. Returns (engine, view)."""
    engine = Engine(model=model, layout=layout, backend="compute", clock="predicted",
                    max_num_batched_tokens=32, **knobs)
    view = KVPlacementView(engine)
    rng = np.random.default_rng(0)
    common = rng.integers(4, 500, 40).tolist()
    first = engine.submit_prompt(common + rng.integers(4, 500, 13).tolist(), 16,
                                 request_id="a")
    while not first.num_output_tokens:
        assert engine.step()
    second = engine.submit_prompt(common[:32] + rng.integers(4, 500, 9).tolist(), 8,
                                  request_id="b")
    while second.num_output_tokens < 3:
        assert engine.step()
    return engine, view


def claimed(frame, gpu, rid) -> list[int]:
    rows = frame[(frame.gpu == gpu) & (frame.request_id == rid) & (frame.kind == "persistent")]
    return sorted(p for row in rows.itertuples() for p in range(row.start, row.end)
                  if (p // row.interleave) % row.shards == row.shard)


def in_flight(engine, dp: int, rid: str) -> list[int]:
    """Positions of rid's tokens in a step its DP rank has planned but not completed."""
    plan = engine._instance_of[dp].plan
    for batch in plan.batches if plan is not None else ():
        for req, context, n in zip(batch.requests, batch.contexts, batch.num_new_tokens):
            if req.request_id == rid:
                return list(range(context, context + n))
    return []


@pytest.mark.parametrize("model,layout,knobs", [
    ("tiny-deepseek-v3", "dcp2", {}),
    ("tiny-deepseek-v3", "pcp2xdcp2", {"dcp_kv_cache_interleave_size": 4}),
    ("tiny-deepseek-v3", "pcp2", {}),  # every PCP rank keeps all of it
    ("tiny-llama", "tp4xdcp2", {"dcp_kv_cache_interleave_size": 2}),
    ("tiny-llama", "dp2xpp2", {}),  # each request on its rank; layers split by stage
])
def test_nonzero_kv_is_where_the_rows_say(model, layout, knobs):
    engine, view = compute_run(model, layout, **knobs)
    frame = view.placement()
    assert set(frame.request_id) == {"a", "b"}
    if engine.layout.dp == 1:  # b hit a's prefix (dp2: they went to different ranks)
        assert (frame.source == "cached").any()
    plane = engine.data_plane
    for gpu, rank in enumerate(plane.ranks):
        dp = rank.place.dp
        for rid in ("a", "b"):
            table = engine.schedulers[dp].kv.table(rid)
            mine = claimed(frame, gpu, rid)
            if engine.requests[rid].rank != dp:
                assert mine == []
                continue
            kv = rank.kv
            assert mine and kv.owned(np.array(mine)).all()
            # a DP rank may have its next step under way (it writes KV when planned)
            running = np.array(in_flight(engine, dp, rid), dtype=np.int64)
            written = np.concatenate([mine, running[kv.owned(running)]])
            expected = set(kv.local_index(written).tolist())
            every = np.arange(len(table) * kv.local_block_size)
            for layer, named in kv.layers.items():
                for name in named:
                    values = kv.gather_at(layer, name, table, every)
                    nonzero = values.flatten(1).abs().sum(1) > 0
                    assert set(np.flatnonzero(nonzero.cpu().numpy()).tolist()) == expected, \
                        (gpu, rid, layer, name)


def test_tp_gpus_hold_the_heads_the_rows_name():
    single, _ = compute_run("tiny-llama", "tp1")
    engine, view = compute_run("tiny-llama", "tp2")
    frame = view.placement()
    for gpu, rank in enumerate(engine.data_plane.ranks):
        heads = {h for value in frame[frame.gpu == gpu].heads for h in value.range}
        assert len(heads) == 1
        for rid in ("a", "b"):
            pos = np.array(claimed(frame, gpu, rid))
            mine, ref = rank.kv, single.data_plane.ranks[0].kv
            for layer in mine.layers:
                for name in ("k", "v"):
                    got = mine.gather_at(layer, name, engine.schedulers[0].kv.table(rid),
                                         mine.local_index(pos))
                    want = ref.gather_at(layer, name, single.schedulers[0].kv.table(rid),
                                         ref.local_index(pos))[:, sorted(heads)]
                    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
