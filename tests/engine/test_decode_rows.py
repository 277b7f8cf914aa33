"""A run of decode steps priced in one compiled loop (`sim/decode_rows.py`) equals the
numpy path of the step model, bit for bit, on every kind of model it takes: dense and
MoE, tensor parallel, fp8 KV, speculative drafts, linear-attention hybrids, each CUDA
graph mode, synchronous scheduling. Models it does not take (MLA, sliding windows,
pipelines, DCP) keep the numpy path."""

from fractions import Fraction

import numpy as np
import pytest

from labkit.costmodel import CostModel
from labkit.engine.capacity import placement_for
from labkit.engine.run_plan import accepted_before, decode_work
from labkit.engine.sim import decode_rows
from labkit.engine.sim.layer_model import LayerStepModel
from labkit.specs import EngineConfig, Layout, get_model

TAKEN = {  # model, layout, hardware, engine knobs
    "dense dp2": ("tiny-llama", "dp2", "h100", {}),
    "moe fp8 kv, sync": ("tiny-qwen3-moe", "dp2", "h100",
                         {"kv_cache_dtype": "fp8", "async_scheduling": False}),
    "bench model, eager": ("qwen3-30b-a3b", "dp2", "h200", {"cudagraph_mode": "NONE"}),
    "tp8 piecewise fp8": ("llama-3.1-70b", "tp8", "h200",
                          {"cudagraph_mode": "PIECEWISE", "kv_cache_dtype": "fp8"}),
    "mtp drafts": ("minimax-m2.5", "tp8", "h200", {"num_speculative_tokens": 3}),
    "linear hybrid": ("qwen3.5-397b-a17b", "tp8", "h200", {"num_speculative_tokens": 1}),
    "full graphs only": ("qwen3-14b", "tp2", "h100", {"cudagraph_mode": "FULL"}),
}
LEFT = {
    "mla": ("tiny-deepseek-v3", "dp2", "h100", {}),
    "sliding window": ("tiny-gpt-oss", "tp1", "h100", {}),
    "pipeline": ("tiny-llama", "tp2xpp2", "h100", {}),
    "dcp": ("tiny-llama", "tp4xdcp2", "h100", {}),
}


def _model(spec, memoize: bool = True) -> LayerStepModel:
    model, layout, hardware, knobs = spec
    config = EngineConfig(max_num_seqs=64, max_num_batched_tokens=4096,
                          sim_step_cache=memoize, **knobs)
    placement = placement_for(get_model(model), Layout.parse(layout), config)
    return LayerStepModel.from_config(placement, CostModel(hardware), config)


def _timings_equal(a, b) -> bool:
    return all(x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
               for x, y in zip((a.busy, a.compute, a.comm, a.duration, a.temporary_kv_bytes),
                               (b.busy, b.compute, b.comm, b.duration, b.temporary_kv_bytes)))


@pytest.mark.parametrize("name", sorted(TAKEN))
def test_compiled_decode_rows_equal_the_numpy_path(name, monkeypatch):
    fast, slow = _model(TAKEN[name]), _model(TAKEN[name])
    assert fast.decode_rows is not None
    slow.decode_rows = None  # the numpy path
    taken = []
    timing = decode_rows.DecodeRows.timing

    def counted(self, work, fixed):
        result = timing(self, work, fixed)
        taken.append(result is not None)
        return result

    monkeypatch.setattr(decode_rows.DecodeRows, "timing", counted)
    rng = np.random.default_rng(11)
    width = 1 + fast.drafts
    acceptance = Fraction(int(rng.integers(1, 4)), 3) * fast.drafts + 1
    for trial in range(60):
        n = int(rng.integers(1, 65))
        k = int(rng.choice([1, 2, 7, 300]))
        base = int(rng.integers(0, 200_000)) * n  # summed context of the n requests
        cum = accepted_before(int(rng.integers(0, 50)), k - 1, acceptance)
        work = decode_work(np.array([n]), np.array([base]), cum, width)
        a, b = fast.step_timing(work, False), slow.step_timing(work, False)
        assert _timings_equal(a, b), (name, trial, n, k)
    assert len(taken) == 60 and all(taken)


def test_a_rank_without_decodes_keeps_the_numpy_path(monkeypatch):
    fast, slow = _model(TAKEN["dense dp2"]), _model(TAKEN["dense dp2"])
    slow.decode_rows = None
    work = decode_work(np.array([0]), np.array([0]), np.zeros(3, dtype=np.int64), 1)
    assert fast.decode_rows.timing(work, fast._piece(
        "counts", fast._count_pieces, False, *fast._counts(work, False))) is None
    assert _timings_equal(fast.step_timing(work, False), slow.step_timing(work, False))


@pytest.mark.parametrize("name", sorted(LEFT))
def test_models_it_cannot_price_keep_the_numpy_path(name):
    assert _model(LEFT[name]).decode_rows is None


def test_without_the_memo_there_are_no_decode_rows():
    assert _model(TAKEN["dense dp2"], memoize=False).decode_rows is None
