"""The compute plane's parts against naive enumerations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from labkit.engine.drafter import ngram_drafts
from labkit.engine.compute.linear_state import LinearStates
from labkit.engine.compute.mesh import Mesh
from labkit.engine.compute.models import init_weights
from labkit.engine.compute.paged_kv import PagedKV
from labkit.engine.compute.rank_weights import rank_weights
from labkit.engine.compute.step_batch import Entry, StepBatch
from labkit.engine.layouts import dcp_shard_tokens
from labkit.specs import Layout, get_model


@pytest.mark.parametrize("pcp", [1, 2, 3])
def test_pcp_rows_split_every_request_into_paired_chunks(pcp):
    sizes = [1, 7, 12, 3]
    entries = [Entry(f"r{i}", 5, n, False, np.array([0]), True) for i, n in enumerate(sizes)]
    batch = StepBatch(entries, list(range(sum(sizes))), block_size=16, pcp=pcp)
    rows = [batch.rows(c) for c in range(pcp)]
    assert sorted(np.concatenate(rows).tolist()) == list(range(sum(sizes)))
    for e in entries:  # rank c holds chunks c and 2*pcp-1-c of each request
        bounds = np.linspace(0, e.num_new, 2 * pcp + 1).round().astype(int) + e.start
        for c in range(pcp):
            want = set(range(bounds[c], bounds[c + 1])) | \
                set(range(bounds[2 * pcp - 1 - c], bounds[2 * pcp - c]))
            got = {r for r in rows[c].tolist() if e.start <= r < e.start + e.num_new}
            assert got == want


def test_step_batch_asks_for_logits_where_tokens_are_sampled():
    entries = [Entry("prefill-mid", 0, 8, False, np.array([1]), samples=False),
               Entry("prefill-end", 16, 4, False, np.array([2, 3]), samples=True),
               Entry("decode", 30, 3, True, np.array([4, 5]), samples=False)]
    batch = StepBatch(entries, list(range(15)), block_size=16)
    assert batch.logit_rows.tolist() == [11, 12, 13, 14]
    assert batch.positions[8:12].tolist() == [16, 17, 18, 19]
    assert batch.block_table.tolist() == [[1, 0], [2, 3], [4, 5]]


@pytest.mark.parametrize("dcp,interleave", [(1, 1), (2, 1), (4, 1), (2, 2), (4, 4)])
def test_dcp_shards_address_their_tokens_like_a_naive_enumeration(dcp, interleave):
    bs, table = 16, np.array([7, 2, 9, 4])
    for j in range(dcp):
        kv = PagedKV({}, num_blocks=10, block_size=bs, dcp=dcp, dcp_index=j,
                     interleave=interleave)
        positions = np.arange(len(table) * bs)
        mine = [p for p in positions if (p // interleave) % dcp == j]
        assert kv.owned(positions).nonzero()[0].tolist() == mine
        # the k-th owned position sits at local index k, in its block's local slots
        assert kv.local_index(np.array(mine)).tolist() == list(range(len(mine)))
        slots = kv.slots(np.array(mine), table[np.array(mine) // bs])
        assert len(set(slots.tolist())) == len(mine)
        assert (slots // kv.local_block_size == table[np.array(mine) // bs]).all()
        for n in (0, 1, 5, 17, 40, 64):
            assert kv.local_len([n])[0] == sum(p < n for p in mine) == \
                dcp_shard_tokens(n, dcp, interleave, j)


def test_paged_kv_writes_copies_and_gathers_by_block_id():
    kv = PagedKV({0: {"latent": (3,)}}, num_blocks=6, block_size=4)
    table = np.array([5, 1])
    values = torch.arange(18, dtype=torch.float32).view(6, 3)
    positions = np.arange(6)
    kv.write(0, "latent", values, kv.slots(positions, table[positions // 4]))
    assert torch.equal(kv.gather(0, "latent", table, 6), values)
    kv.copy_blocks([(1, 2)])
    assert torch.equal(kv.gather(0, "latent", np.array([5, 2]), 6), values)


@pytest.mark.parametrize("tokens,k,want", [
    ([1, 2, 3, 9, 1, 2, 3], 2, [9, 1]),      # the longest matching suffix wins
    ([5, 6, 7, 5, 6], 3, [7, 5, 6]),
    ([4, 8, 4], 3, [8, 4, 4]),               # runs out: repeat the last proposal
    ([1, 2, 3], 2, [3, 3]),                  # no match: repeat the last token
    ([3], 1, [3]),
    ([1, 2], 0, []),
])
def test_ngram_drafter(tokens, k, want):
    assert ngram_drafts(tokens, k) == want


def test_linear_states_are_kept_by_position():
    s = LinearStates()
    assert s.get(0, "r", 0) is None
    for p in (4, 5, 6):
        s.put(0, "r", p, f"after {p}")
    assert s.get(0, "r", 5) == "after 5"  # the accepted length; later candidates go
    with pytest.raises(RuntimeError, match="after 6 tokens"):
        s.get(0, "r", 6)
    s.release("r")
    assert len(s) == 0


@pytest.mark.parametrize("layout,model,dcp_groups", [
    ("tp4xdcp2", "tiny-deepseek-v3", [(0, 1), (0, 1), (2, 3), (2, 3)]),
    ("tp2xpcp2xdcp2", "tiny-llama", [(0, 2), (1, 3), (0, 2), (1, 3)]),
    ("pcp2xdcp2", "tiny-deepseek-v3", [(0, 1), (0, 1)]),
    ("tp4xdcp2", "tiny-llama", [(0, 1), (0, 1), (2, 3), (2, 3)]),
])
def test_dcp_groups_join_gpus_that_would_hold_the_same_kv(layout, model, dcp_groups):
    mesh = Mesh(Layout.parse(layout), get_model(model))
    assert [p.dcp_group for p in mesh.places] == dcp_groups


def test_mesh_numbers_gpus_by_replica_stage_pcp_tp():
    mesh = Mesh(Layout.parse("dp2xtp2xpp2"), get_model("tiny-llama"))
    p = mesh.places[5]  # replica 1, stage 0, tp index 1
    assert (p.dp, p.stage, p.tp_index) == (1, 0, 1)
    assert p.tp_group == (4, 5) and p.pp_group == (5, 7)
    assert list(p.layers) == [0] and list(mesh.places[7].layers) == [1]
    dep = Mesh(Layout.parse("dep4"), get_model("tiny-qwen3-moe"))
    assert all(q.ep_group == (0, 1, 2, 3) for q in dep.places)


def test_rank_weights_split_heads_replicate_latents_and_own_whole_experts():
    spec = get_model("tiny-deepseek-v3")
    full = init_weights(spec)
    mesh = Mesh(Layout.parse("tp2xep2"), spec)
    w = [rank_weights(spec, full, p, mesh.layout) for p in mesh.places]
    name = "self_attn.q_b_proj.weight"
    assert torch.equal(torch.cat([w[0][1][name], w[1][1][name]]),
                       full[f"model.layers.1.{name}"])
    latent = "self_attn.kv_a_proj_with_mqa.weight"
    assert torch.equal(w[0][1][latent], w[1][1][latent])
    experts = [{k.split(".")[2] for k in r[1] if k.startswith("mlp.experts.")} for r in w]
    assert experts == [{"0", "1", "2", "3"}, {"4", "5", "6", "7"}]
    assert torch.equal(w[1][1]["mlp.experts.5.down_proj.weight"],
                       full["model.layers.1.mlp.experts.5.down_proj.weight"])
