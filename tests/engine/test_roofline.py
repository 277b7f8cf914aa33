"""The roofline cost model against its defining formulas and physical sanity."""

import numpy as np
import pytest

from labkit.engine.sim.roofline import RooflineCostModel, _distinct_expert_table
from labkit.engine.step_work import StepWork
from labkit.specs import Layout, get_hardware, get_model


def work(prefill=0, decode=0, reqs_p=0, reqs_d=0, ctx=0, pairs_p=0, pairs_d=0, ranks=1):
    col = lambda v: np.full((1, ranks), v, dtype=np.int64)  # noqa: E731
    return StepWork(col(prefill), col(decode), col(reqs_p), col(reqs_d), col(ctx),
                    col(pairs_p), col(pairs_d), col(reqs_p + reqs_d == 0).astype(bool))


def model(name="llama-3.1-8b", layout="tp1", hw="h200"):
    return RooflineCostModel(get_model(name), get_hardware(hw), Layout.parse(layout))


def test_small_decode_is_bound_by_reading_the_weights():
    m, hw = get_model("llama-3.1-8b"), get_hardware("h200")
    cm = model()
    t = cm.step_timing(work(decode=1, reqs_d=1, ctx=1, pairs_d=1), lockstep=False)
    # every weight but the input embedding is read once, in bf16, at 85 % of peak BW
    weights = (m.total_params() - m.vocab_size * m.hidden_size) * 2
    expected = weights / (hw.hbm_bandwidth * 0.85) + 1e-3 + 8e-6 * m.num_layers
    assert t.busy[0, 0] == pytest.approx(expected, rel=1e-3)


def test_big_prefill_is_bound_by_flops():
    m, hw = get_model("llama-3.1-8b"), get_hardware("h200")
    n = 8192
    t = model().step_timing(work(prefill=n, reqs_p=1, ctx=n, pairs_p=n * (n + 1) // 2), False)
    gemm = 2 * (m.total_params() - 2 * m.vocab_size * m.hidden_size) * n
    attn = 4 * m.num_heads * m.head_dim * m.num_layers * n * (n + 1) // 2
    lm_head = 2 * m.vocab_size * m.hidden_size  # logits for the last token only
    expected = (gemm + attn + lm_head) / (hw.flops_bf16 * 0.75) + 1e-3 + 8e-6 * m.num_layers
    assert t.busy[0, 0] == pytest.approx(expected, rel=1e-3)


def test_costs_grow_with_context_and_batch():
    cm = model()
    times = [cm.step_timing(work(decode=b, reqs_d=b, ctx=b * c, pairs_d=b * c), False).busy[0, 0]
             for b, c in [(8, 1000), (8, 100_000), (64, 100_000)]]
    assert times[0] < times[1] < times[2]


def test_tensor_parallel_splits_work_and_pays_all_reduces():
    w = work(decode=32, reqs_d=32, ctx=32 * 4000, pairs_d=32 * 4000)
    one = model("llama-3.1-70b", "tp2").step_timing(w, False)
    eight = model("llama-3.1-70b", "tp8").step_timing(w, False)
    assert eight.busy[0, 0] < one.busy[0, 0]
    assert eight.comm[0, 0] > 0


def test_lockstep_step_lasts_as_long_as_the_slowest_rank():
    cm = model("qwen3-30b-a3b", "dep4")
    w = work(decode=4, reqs_d=4, ctx=40_000, pairs_d=40_000, ranks=4)
    w.prefill_tokens[0, 2] = 4096  # one rank also prefills a chunk
    w.num_prefill_reqs[0, 2] = 1
    w.prefill_pairs[0, 2] = 4096 * 20_000
    w.idle[0, 3] = True  # and one has nothing to do: a dummy step
    for f in ("decode_tokens", "num_decode_reqs", "kv_read_tokens", "decode_pairs"):
        getattr(w, f)[0, 3] = 0
    t = cm.step_timing(w, lockstep=True)
    assert t.duration[0] == t.busy[0].max() == t.busy[0, 2]
    assert np.allclose(t.stall[0], t.busy[0, 2] - t.busy[0])
    assert t.busy[0, 3] > cm.min_step_s  # the dummy step still costs something


def test_expected_distinct_experts():
    table = _distinct_expert_table(8)
    assert table[0] == 0 and table[1] == pytest.approx(1.0)
    # two selections: both hit the same expert with probability 1/8
    assert table[2] == pytest.approx(2 - 1 / 8)
    assert table[-1] == pytest.approx(8.0)
