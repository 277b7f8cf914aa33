"""Behaviours practitioners report, as they come out of the model (nothing in the
engine or the cost model is written to produce them). A change that flips one should
be a deliberate, explained one: these tests make it visible."""

import pytest

from labkit.behaviours import cold_prefill_seconds, dcp_overhead_vs_context, dep_vs_dcp
from labkit.costmodel import CostModel


@pytest.fixture(scope="module")
def cm():
    return CostModel("h200")


def test_dcp_prefill_overhead_grows_with_the_cached_context(cm):
    rows = dcp_overhead_vs_context(cm, contexts=(8192, 131072, 524288))
    prefill = [r["prefill_overhead_ms"] for r in rows]
    assert prefill[0] < prefill[1] < prefill[2]
    # decode steps: DCP's gain (less KV read per GPU) grows with the context instead
    decode = [r["decode_overhead_ms"] for r in rows]
    assert decode[0] > decode[1] > decode[2]


def test_pcp_beats_tp_on_long_prefills_of_sparse_attention(cm):
    dsa = cold_prefill_seconds(cm, "deepseek-v3.2", "pcp8xep8", tokens=65536) / \
        cold_prefill_seconds(cm, "deepseek-v3.2", "tp8", tokens=65536)
    dense = cold_prefill_seconds(cm, "deepseek-v3", "pcp8xep8", tokens=65536) / \
        cold_prefill_seconds(cm, "deepseek-v3", "tp8", tokens=65536)
    assert dsa < 1 < dense  # the indexer every TP rank reruns is what PCP splits


def test_dep_overtakes_dcp_as_the_per_rank_batch_grows(cm):
    rows = dep_vs_dcp(cm, batches=(1, 2, 16, 64))
    assert [r["winner"] for r in rows] == ["tp8xdcp8", "tp8xdcp8", "dep8", "dep8"]


def test_pp_pays_off_on_cold_prompts_but_not_on_decode(cm):
    assert cold_prefill_seconds(cm, "llama-3.1-70b", "tp4xpp2", tokens=65536) < \
        cold_prefill_seconds(cm, "llama-3.1-70b", "tp8", tokens=65536)
    decode = [{"new_tokens": 1, "context": 32768}] * 32
    assert cm.step_time("llama-3.1-70b", "tp4xpp2", decode)["seconds"] > \
        cm.step_time("llama-3.1-70b", "tp8", decode)["seconds"]
