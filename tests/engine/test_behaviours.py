"""Behaviours practitioners report, as they come out of the model (nothing in the
engine or the cost model is written to produce them). A change that flips one should
be a deliberate, explained one: these tests make it visible."""

import pytest

from labkit.behaviours import (
    cold_prefill_seconds, dcp_overhead_vs_context, dep_vs_dcp, moved, verdict_of)
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


def test_a_dsa_prefill_chunk_never_up_projects_its_prefix(cm):
    """vLLM's sparse MLA backends run DSA prefill in latent space: what a 512-token chunk
    pays for 100K cached tokens (indexer scores, the fp8 dequantised latents) stays far
    below dense MLA's per-chunk up-projection of that prefix (kv_b: 100K x 512 -> 128 x
    256), which DeepSeek-V3 does pay."""
    kv_b = 61 * cm.gemm(100_000, 128 * 256, 512)
    growth = {}
    for model in ("deepseek-v3.2", "deepseek-v3"):
        near, far = (cm.step_time(model, "dep8", [[{"new_tokens": 512, "context": c}]],
                                  kv_dtype="fp8")["seconds"] for c in (0, 100_000))
        growth[model] = far - near
    assert growth["deepseek-v3.2"] < 0.5 * kv_b < growth["deepseek-v3"]


@pytest.mark.parametrize("before,after,expected", [
    (100.0, 104.0, 1), (100.0, 96.0, -1), (100.0, 102.9, 0), (100.0, 97.1, 0),
    (0.0, 5.0, 0), (float("nan"), 1.0, 0)])
def test_moved_reads_a_change_beyond_the_noise_band(before, after, expected):
    assert moved(before, after) == expected


def test_verdicts_follow_the_moves():
    assert verdict_of([1, 1], [1, 1]) == "agrees"
    assert verdict_of([-1, -1], [1, 1]) == "disagrees"
    assert verdict_of([-1, 1], [-1, -1]) == "mixed"
    assert verdict_of([0, 1], [1, 1]) == "mixed"  # no change is not agreement
