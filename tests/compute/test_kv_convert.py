"""A request's KV converted between compute data planes of different layouts.

A prompt is prefilled (in chunks) on each layout; its KV, exported to logical tensors,
must match the single-GPU run's (different layouts add in different orders, hence the
layout tests' tolerance: 1e-5 of the tensor's largest entry), and must survive an import
into other blocks — of the same plane, or of a plane with another layout (prefill
`pcp2xdcp2` -> decode `dp2` / `tp2`) — bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from compute_cases import REL_TOL, compute_engine, max_rel_error

from labkit.engine.compute.kv_convert import export_kv, import_kv
from labkit.specs import get_model

PROMPT_LEN = 45  # two full blocks of 16 and a partial one
NUM_BLOCKS = 64
ROUND_TRIP = {
    "tiny-llama": ["tp1", "tp2", "tp4xdcp2", "pcp2", "pcp2xdcp2", "pp2"],
    "tiny-deepseek-v3": ["tp2", "dcp2", "pcp2xdcp2"],
    "tiny-deepseek-v3.2": ["dcp2"],
}
CASES = [(m, lo) for m, layouts in ROUND_TRIP.items() for lo in layouts]

_prefilled: dict = {}


def engine(model: str, layout: str, **knobs):
    return compute_engine(model, layout, num_gpu_blocks_override=NUM_BLOCKS,
                          max_num_batched_tokens=32, **knobs)


def prefilled(model: str, layout: str, **knobs):
    """An engine whose request "a" has just computed its whole prompt (still running),
    with the request, its block table, and the exported KV of the prompt."""
    key = (model, layout, tuple(sorted(knobs.items())))
    if key not in _prefilled:
        eng = engine(model, layout, **knobs)
        rng = np.random.default_rng(7)
        eng.submit_prompt(rng.integers(4, get_model(model).vocab_size, PROMPT_LEN).tolist(),
                          64, request_id="a")
        req = eng.requests["a"]
        for _ in range(10):
            if req.num_computed_tokens >= PROMPT_LEN:
                break
            eng.step()
        table, n = eng.schedulers[req.rank].kv.held_blocks(req)
        assert n >= PROMPT_LEN and req.finish_s is None
        table = np.array(table)
        data = export_kv(eng.data_plane, req.rank, table, PROMPT_LEN)
        _prefilled[key] = eng, req, table, data
    return _prefilled[key]


def fresh_blocks(table: np.ndarray, num_blocks: int = NUM_BLOCKS) -> np.ndarray:
    """Unused blocks at the top of the pool, in reverse order (not the source's ids)."""
    fresh = np.arange(num_blocks - 1, num_blocks - 1 - len(table), -1)
    assert not set(fresh.tolist()) & set(table.tolist())
    return fresh


def assert_same(got, want, exact: bool = True) -> None:
    assert got.keys() == want.keys()
    for layer in want:
        assert got[layer].keys() == want[layer].keys()
        for name, w in want[layer].items():
            g = got[layer][name]
            assert g.shape == w.shape, (layer, name)
            if exact:
                assert torch.equal(g, w), (layer, name)
            else:  # the layout tests' bar (deeper layers drift ~1e-6 at entries near 0)
                err = max_rel_error(g, w)
                assert err < REL_TOL, (layer, name, err)


def shapes(model: str) -> dict:
    spec = get_model(model)
    if spec.is_mla:
        named = {"latent": (PROMPT_LEN, spec.kv_lora_rank + spec.qk_rope_head_dim)}
        if spec.has_indexer:
            named["index_k"] = (PROMPT_LEN, spec.index_head_dim)
    else:
        kv = (PROMPT_LEN, spec.num_kv_heads, spec.head_dim)
        named = {"k": kv, "v": kv}
    return {layer: named for layer in range(spec.num_layers)}


@pytest.mark.parametrize("model,layout", CASES)
def test_round_trip_matches_single_gpu(model, layout):
    _, _, _, want = prefilled(model, "tp1")
    eng, req, table, data = prefilled(model, layout)
    assert {layer: {k: tuple(t.shape) for k, t in named.items()}
            for layer, named in data.items()} == shapes(model)
    assert all(t.abs().max() > 0 for named in data.values() for t in named.values())
    assert_same(data, want, exact=False)

    plane, fresh = eng.data_plane, fresh_blocks(table)
    import_kv(plane, req.rank, fresh, data)
    assert_same(export_kv(plane, req.rank, fresh, PROMPT_LEN), data)


def test_round_trip_with_interleaved_dcp_shards():
    _, _, _, want = prefilled("tiny-llama", "tp1")
    eng, req, table, data = prefilled("tiny-llama", "pcp2xdcp2",
                                      dcp_kv_cache_interleave_size=4)
    assert_same(data, want, exact=False)
    fresh = fresh_blocks(table)
    import_kv(eng.data_plane, req.rank, fresh, data)
    assert_same(export_kv(eng.data_plane, req.rank, fresh, PROMPT_LEN), data)


def test_export_from_start_and_import_of_a_suffix():
    eng, req, table, data = prefilled("tiny-deepseek-v3", "pcp2xdcp2")
    plane, start = eng.data_plane, 21  # mid-block, and not on a DCP cycle boundary
    tail = export_kv(plane, req.rank, table, PROMPT_LEN, start=start)
    assert_same(tail, {layer: {k: t[start:] for k, t in named.items()}
                       for layer, named in data.items()})
    # a destination holding the prefix already (shared via its first block) takes the rest
    fresh = fresh_blocks(table)
    head = {layer: {k: t[:start] for k, t in named.items()} for layer, named in data.items()}
    import_kv(plane, req.rank, fresh, head)
    import_kv(plane, req.rank, fresh, tail, start=start)
    assert_same(export_kv(plane, req.rank, fresh, PROMPT_LEN), data)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-deepseek-v3"])
@pytest.mark.parametrize("decode_layout,dp_rank", [("dp2", 1), ("tp2", 0)])
def test_prefill_layout_into_decode_layout(model, decode_layout, dp_rank):
    _, _, table, data = prefilled(model, "pcp2xdcp2")
    decode = engine(model, decode_layout)
    plane = decode.data_plane
    blocks = np.array([5, 2, 9])
    import_kv(plane, dp_rank, blocks, data)
    assert_same(export_kv(plane, dp_rank, blocks, PROMPT_LEN), data)
    # only the destination replica's GPUs were written
    others = [g for g in range(plane.mesh.world_size)
              if g not in plane.mesh.replica_gpus(dp_rank)]
    for g in others:
        assert all(not t.any() for named in plane.ranks[g].kv.layers.values()
                   for t in named.values())
    # ... and back, into the prefill layout's own shards
    prefill = engine(model, "pcp2xdcp2")
    import_kv(prefill.data_plane, 0, blocks, export_kv(plane, dp_rank, blocks, PROMPT_LEN))
    assert_same(export_kv(prefill.data_plane, 0, blocks, PROMPT_LEN), data)


@pytest.mark.parametrize("model,layout", [
    ("tiny-llama", "tp4"),  # 2 KV heads: each held by two TP ranks
    ("tiny-llama", "pcp2"),  # every PCP member keeps a full copy
    ("tiny-llama", "tp2xpcp2xdcp2"),  # the PCP copies of each head shard by token
    ("tiny-deepseek-v3", "tp2xpcp2"),  # one latent, four copies
])
def test_import_writes_every_copy(model, layout):
    _, _, _, data = prefilled(model, "tp1")
    plane = engine(model, layout).data_plane
    blocks = np.array([3, 4, 5])
    import_kv(plane, 0, blocks, data)
    for gpu in plane.mesh.replica_gpus(0):
        kv, place = plane.ranks[gpu].kv, plane.mesh.places[gpu]
        positions = np.nonzero(kv.owned(np.arange(PROMPT_LEN)))[0]
        for layer, named in kv.layers.items():
            for name, cache in named.items():
                want = data[layer][name][torch.as_tensor(positions)]
                if name in ("k", "v"):
                    here = cache.shape[2]
                    first = plane.mesh.heads_class(place.tp_index) * here
                    want = want[:, first:first + here]
                got = kv.gather(layer, name, blocks, len(positions))
                assert torch.equal(got, want), (gpu, layer, name)


def test_blocks_too_short_are_rejected():
    eng, req, table, data = prefilled("tiny-llama", "tp2")
    with pytest.raises(ValueError, match=r"2 blocks of 16 tokens cannot hold 45 tokens "
                                         r"\(need 3\)"):
        export_kv(eng.data_plane, req.rank, table[:2], PROMPT_LEN)
    with pytest.raises(ValueError, match=r"2 blocks of 16 tokens cannot hold 45 tokens"):
        import_kv(eng.data_plane, req.rank, fresh_blocks(table)[:2], data)
    with pytest.raises(ValueError, match=r"outside the pool of 64 blocks"):
        export_kv(eng.data_plane, req.rank, np.array([0, 1, 64]), PROMPT_LEN)
    with pytest.raises(ValueError, match=r"DP rank 1 does not exist"):
        export_kv(eng.data_plane, 1, table, PROMPT_LEN)


def test_mismatched_data_is_rejected():
    _, _, _, llama = prefilled("tiny-llama", "tp1")
    _, _, _, mla = prefilled("tiny-deepseek-v3", "tp1")
    plane = engine("tiny-llama", "tp2").data_plane
    blocks = np.array([1, 2, 3])
    with pytest.raises(ValueError, match=r"layer 0 'k': expected \[T, 2, 16\] KV, got none"):
        import_kv(plane, 0, blocks, mla)
    with pytest.raises(ValueError, match=r"no layer 1"):
        import_kv(plane, 0, blocks, {0: llama[0]})
    short_v = {layer: {"k": named["k"], "v": named["v"][:-1]} for layer, named in llama.items()}
    with pytest.raises(ValueError, match=r"disagree on the number of positions"):
        import_kv(plane, 0, blocks, short_v)


def test_wrong_head_mapping_fails_instead_of_leaving_zeros(monkeypatch):
    eng, req, table, _ = prefilled("tiny-llama", "tp2")
    monkeypatch.setattr(eng.data_plane.mesh, "heads_class", lambda tp_index: 0)
    with pytest.raises(ValueError, match=r"layer 0 'k': no GPU of DP rank 0 of layout "
                                         r"'tp2' holds positions \[0, 1, .*heads \[1\]"):
        export_kv(eng.data_plane, req.rank, table, PROMPT_LEN)
