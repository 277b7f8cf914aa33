"""MoE routing imbalance: the busiest EP rank's load from the calibration data's power
law, against an independent Monte Carlo; EPLB's replication and packing worked by hand
(DeepSeek's EPLB as vLLM's default policy runs it); EPLB lowering the maximum."""

import numpy as np
import pytest

from labkit.costmodel import CostModel
from labkit.costmodel.routing import busiest_factor, rank_loads, replicate


def naive_busiest(tokens, experts, topk, ep, alpha, draws, seed):
    """The collector's recipe, written independently: each expert's count drawn from
    p(x) ∝ x^-alpha on [1, 0.8 T] by inverting a numerically integrated CDF, scaled to
    T·topk; ranks hold contiguous groups; E[max rank] / (T·topk / ep)."""
    rng = np.random.default_rng(seed)
    lo, hi = (1.0, 0.8 * tokens) if tokens * topk > experts else (0.01, 2.0)
    grid = np.geomspace(lo, hi, 200_001)
    pdf = grid ** -alpha
    cdf = np.concatenate([[0.0], np.cumsum((pdf[1:] + pdf[:-1]) / 2 * np.diff(grid))])
    cdf /= cdf[-1]
    busiest = []
    for _ in range(draws):
        counts = np.interp(rng.random(experts), cdf, grid)
        counts = counts / counts.sum() * tokens * topk
        busiest.append(max(counts[r * experts // ep:(r + 1) * experts // ep].sum()
                           for r in range(ep)))
    return np.mean(busiest) / (tokens * topk / ep)


@pytest.mark.parametrize("tokens, experts, topk, ep, alpha", [
    (4096, 256, 8, 16, 1.2), (512, 256, 8, 8, 1.01), (8192, 8, 2, 4, 1.2), (8, 128, 8, 8, 1.2)])
def test_expected_busiest_rank_matches_monte_carlo(tokens, experts, topk, ep, alpha):
    routing = f"power_law_{alpha}"
    model = busiest_factor(tokens, experts, topk, ep, routing, layers=3000, seed=1)
    mc = naive_busiest(tokens, experts, topk, ep, alpha, draws=3000, seed=2)
    assert model == pytest.approx(mc, rel=0.04)
    assert model > 1.05  # skewed routing does load one rank more than its share


def test_no_imbalance_without_ep_or_with_balanced_routing():
    assert busiest_factor(4096, 256, 8, 1, "power_law_1.2") == 1.0
    assert busiest_factor(4096, 256, 8, 16, "balanced") == 1.0


def test_eplb_replicates_the_hot_expert_and_packs_by_hand():
    """Loads 10,1,...,1 over 4 ranks with 4 redundant slots: each slot goes to the expert
    with the most load per replica — expert 0 five times (5, 3.33, 2.5, 2) — then the 12
    replicas, heaviest first, onto the lightest rank with a free slot (3 per rank):
    2,2,2,2 on ranks 0..3, the fifth 2 on rank 0, the 1s fill ranks 1..3 then 0."""
    load = np.array([[10.0, 1, 1, 1, 1, 1, 1, 1]])
    assert replicate(load, 12).tolist() == [[5, 1, 1, 1, 1, 1, 1, 1]]
    assert sorted(rank_loads(load, 4, num_redundant=4)[0]) == [4.0, 4.0, 4.0, 5.0]
    assert rank_loads(load, 4)[0].tolist() == [11.0, 2.0, 2.0, 2.0]  # contiguous, no EPLB


def test_eplb_lowers_the_busiest_rank_most_for_large_batches():
    kw = dict(layers=58, seed=0, sampled=True)
    plain = busiest_factor([16, 16384], 256, 8, 16, "power_law_1.2", **kw)
    eplb = busiest_factor([16, 16384], 256, 8, 16, "power_law_1.2", num_redundant=32, **kw)
    assert (eplb < plain).all()
    assert eplb[1] < 1.05  # a big batch: the per-step scatter is small, EPLB near perfect
    assert eplb[0] > 1.2  # a few tokens: scatter dominates, no placement balances it


def test_seeded_and_deterministic():
    a = busiest_factor(1000, 256, 8, 8, "power_law_1.2", seed=3, sampled=True, layers=20)
    b = busiest_factor(1000, 256, 8, 8, "power_law_1.2", seed=3, sampled=True, layers=20)
    c = busiest_factor(1000, 256, 8, 8, "power_law_1.2", seed=4, sampled=True, layers=20)
    assert a == b and a != c


def test_moe_prices_the_busiest_rank():
    cm = CostModel("h200")
    args = (8192, 7168, 2048, 8, 256)
    balanced = cm.moe(*args, ep_size=16, dtype="fp8_block")
    skewed = cm.moe(*args, ep_size=16, dtype="fp8_block", distribution="power_law_1.2")
    assert skewed > balanced
    assert cm.moe(*args, ep_size=16, dtype="fp8_block", distribution="power_law_1.2",
                  load_factor=1.0) < skewed  # a perfectly balancing EPLB


def test_per_tensor_fp8_moe_is_its_own_slower_kernel():
    cm = CostModel("h100")
    args = (256, 7168, 2048, 8, 256)
    assert cm.moe(*args, dtype="fp8") > 1.5 * cm.moe(*args, dtype="fp8_block")


def test_eplb_in_the_engine():
    """dep8 deepseek-v3 with a big batch: EPLB's replicas cut the step; they cost weight
    memory per GPU (more experts each)."""
    from labkit.engine.capacity import capacity

    cm = CostModel("h200")
    batch = [[{"new_tokens": 1024, "context": 0}]] * 8
    plain = cm.step_time("deepseek-v3", "dep8", batch)["seconds"]
    eplb = cm.step_time("deepseek-v3", "dep8", batch, enable_eplb=True,
                        num_redundant_experts=32)["seconds"]
    assert eplb < plain
    a = capacity("deepseek-v3", "dep8", context=8192)
    b = capacity("deepseek-v3", "dep8", context=8192, enable_eplb=True,
                 num_redundant_experts=32)
    # 32 more experts of 44 M parameters (fp8: bytes) on 58 layers, over 8 GPUs
    extra = 32 * 3 * 7168 * 2048 * 58 / 8
    assert b["weights_bytes_per_gpu"] - a["weights_bytes_per_gpu"] == pytest.approx(extra)
    assert b["kv_capacity_tokens_per_gpu"] < a["kv_capacity_tokens_per_gpu"]
