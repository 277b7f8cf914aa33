"""`CostModel.step_time` and the engine's steps agree; the steps table adds up."""

import numpy as np
import pytest

from labkit import Engine
from labkit.costmodel import CostModel
from labkit.engine.scheduler import RankBatch
from support import small_agentx


def test_step_time_reports_the_slowest_rank_and_each_rank_s_stall():
    cm = CostModel("h200")
    decode = [{"new_tokens": 4, "context": 20000}] * 4
    prefill = [{"new_tokens": 8192, "context": 20000}]
    out = cm.step_time("deepseek-v3", "dep4", [decode, decode + prefill, [], decode],
                       num_speculative_tokens=3)
    ranks = out["per_rank"]
    assert len(ranks) == 4
    slowest = max(r["seconds"] for r in ranks)
    assert out["seconds"] == slowest == ranks[1]["seconds"]  # the prefilling rank
    for r in ranks:
        assert r["stall_s"] == pytest.approx(slowest - r["seconds"])
        assert r["seconds"] >= r["compute_s"] + r["comm_s"]
    assert ranks[2]["seconds"] > 0  # an idle rank still runs a dummy step
    assert out["compute_s"] == ranks[1]["compute_s"]


def test_engine_steps_cost_what_step_time_says():
    """Rebuild every step's batch from the scheduler and price it with step_time."""
    engine = Engine("tiny-qwen3-moe", "dep2", "h200", block_size=16,
                    num_speculative_tokens=2, acceptance_length=2.5, sim_fast_forward=False)
    seen = []
    for s in engine.schedulers:
        original = s.schedule

        def wrapped(step_index, *args, _orig=original, _rank=s.rank):
            batch = _orig(step_index, *args)
            seen.append((step_index, _rank, [
                {"new_tokens": n, "context": c, "decode": d}
                for n, c, d in zip(batch.num_new_tokens, batch.contexts, batch.is_decode)]))
            return batch
        s.schedule = wrapped
    result = engine.replay(small_agentx(4, seed=2), concurrency=3, duration_s=20)
    cm = CostModel("h200")
    steps = result.steps.set_index(["step", "rank"])
    by_step = {}
    for step, rank, entries in seen:
        by_step.setdefault(step, [None, None])[rank] = entries
    checked = 0
    for step, ranks in list(by_step.items())[:200]:
        if (step, 0) not in steps.index:
            continue
        out = cm.step_time("tiny-qwen3-moe", "dep2", ranks, num_speculative_tokens=2)
        assert steps.loc[(step, 0), "duration_s"] == pytest.approx(out["seconds"], rel=1e-12)
        for r in range(2):
            assert steps.loc[(step, r), "stall_s"] == pytest.approx(
                out["per_rank"][r]["stall_s"], rel=1e-9, abs=1e-15)
        checked += 1
    assert checked > 50


def test_steps_table_breaks_time_and_kv_down():
    engine = Engine("tiny-deepseek-v3", "pcp2xdcp2xep2", "h200", block_size=16,
                    max_model_len=1 << 20)
    result = engine.replay(small_agentx(3, seed=4), concurrency=2, duration_s=30)
    st = result.steps
    # busy = max(kernels, CPU) + the step gap under async scheduling (overheads.py):
    # never less than the kernels plus the gap, never more than everything added up
    o = engine.cost_model.overheads
    gpu = st["compute_s"] + st["comm_s"]
    tokens = st["prefill_tokens"] + st["decode_tokens"]
    reqs = st["num_prefill_reqs"] + st["num_decode_reqs"]
    worst = o.cpu_s(reqs, tokens) + o.params.eager_layer_s * o.layers
    assert (st["busy_s"] >= gpu + o.params.step_gap_s - 1e-15).all()
    assert (st["busy_s"] <= gpu + worst + o.params.step_gap_s + 1e-15).all()
    assert (st["comm_s"] > 0).all()
    per_block = engine.block_size * engine.placement.kv_bytes_per_token_per_gpu()
    assert np.allclose(st["persistent_kv_bytes"], st["kv_used_blocks"] * per_block)
    prefill = st["prefill_tokens"] > 0
    assert (st.loc[prefill, "temporary_kv_bytes"] > 0).all()  # PCPxDCP gathers per layer
    assert (st.loc[~prefill, "temporary_kv_bytes"] == 0).all()


def test_step_time_rejects_bad_batches():
    from labkit.errors import ConfigError

    cm = CostModel("h100")
    with pytest.raises(ConfigError, match="new_tokens"):
        cm.step_time("llama-3.1-8b", "tp1", [{"new_tokens": 0, "context": 5}])
    with pytest.raises(ConfigError, match="DP rank"):
        cm.step_time("llama-3.1-8b", "tp1", [[{"new_tokens": 1, "context": 5}]] * 2)
    assert RankBatch  # the engine's batch type is what step_time builds
