"""A run of one rank's steps priced in one compiled loop (`sim/compiled_rows.py`) — runs
of decodes, and the steps that carry a prompt's chunks — equals the numpy path of the
step model, bit for bit, on every kind of model it takes: dense and MoE, tensor
parallel, fp8 KV, speculative drafts, linear-attention hybrids, each CUDA graph mode,
synchronous scheduling. Models it does not take (MLA, sliding windows, pipelines, DCP)
keep the numpy path. So do the count pieces read off a block of prefill sizes
(`sim/count_blocks.py`): the same numbers as the step's own."""

from fractions import Fraction

import numpy as np
import pytest

from labkit.costmodel import CostModel
from labkit.engine.capacity import placement_for
from labkit.engine.run_plan import accepted_before, decode_work
from labkit.engine.sim import compiled_rows
from labkit.engine.sim.count_blocks import BLOCK
from labkit.engine.sim.layer_model import LayerStepModel
from labkit.engine.step_work import StepWork
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


def _count_taken(monkeypatch) -> list:
    """A list that gets, for each run the compiled loop is asked to price, whether it
    took it."""
    taken = []
    timing = compiled_rows.CompiledRows.timing

    def counted(self, work, counts):
        result = timing(self, work, counts)
        taken.append(result is not None)
        return result

    monkeypatch.setattr(compiled_rows.CompiledRows, "timing", counted)
    return taken


@pytest.mark.parametrize("name", sorted(TAKEN))
def test_compiled_decode_runs_equal_the_numpy_path(name, monkeypatch):
    fast, slow = _model(TAKEN[name]), _model(TAKEN[name])
    assert fast.compiled_rows is not None
    slow.compiled_rows = None  # the numpy path
    taken = _count_taken(monkeypatch)
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


def _chunk_run(rng, width: int) -> StepWork:
    """k steps of one rank: requests decoding, continuing a prompt chunk by chunk (two
    prompts in a step, sometimes) and then decoding, or sitting a step out."""
    n, k = int(rng.integers(1, 6)), int(rng.choice([1, 2, 5, 40]))
    context = np.zeros((n, k), dtype=np.int64)
    new = np.zeros((n, k), dtype=np.int64)
    prefill = np.zeros((n, k), dtype=bool)
    for i in range(n):
        held, kind = int(rng.integers(0, 300_000)), rng.choice(["decode", "prompt", "idle"])
        chunks = int(rng.integers(1, k + 1)) if kind == "prompt" else 0  # then it decodes
        for j in range(k):
            if kind == "idle" and rng.random() < 0.5:
                context[i, j] = held
                continue
            t = int(rng.integers(1, 4097)) if j < chunks else width
            context[i, j], new[i, j], prefill[i, j] = held, t, j < chunks
            held += t
    return StepWork.from_entries(np.zeros(n, dtype=np.int64), 1, context, new, prefill)


@pytest.mark.parametrize("name", sorted(TAKEN))
def test_compiled_chunk_runs_equal_the_numpy_path(name, monkeypatch):
    fast, slow, plain = _model(TAKEN[name]), _model(TAKEN[name]), _model(TAKEN[name], False)
    slow.compiled_rows = slow.count_blocks = None  # the numpy path, with the memo
    taken = _count_taken(monkeypatch)
    rng = np.random.default_rng(5)
    for trial in range(60):
        work = _chunk_run(rng, fast.width)
        a, b, c = (m.step_timing(work, False) for m in (fast, slow, plain))
        assert _timings_equal(a, b) and _timings_equal(a, c), (name, trial)
    assert len(taken) == 60 and all(taken)
    assert fast.count_blocks._blocks  # some steps read their count pieces off a block


def _numbers(pieces) -> list:
    """Every number and None in the count pieces, in order, as bytes (a Python float
    and a numpy one with the same value are the same number)."""
    if isinstance(pieces, tuple):
        return [x for p in pieces for x in _numbers(p)]
    if pieces is None:
        return [None]
    return [np.asarray(pieces).dtype.kind, np.float64(pieces).tobytes()]


def _chunk_step_counts(rng, width: int, n: int = 40):
    """n random counts of one rank's step with a prompt chunk (numbers, as `_counts`
    gives them): chunks across three blocks, 0-4 decodes, 1-2 prompts."""
    for _ in range(n):
        prefill = int(rng.integers(1, 3 * BLOCK))
        decodes = int(rng.integers(0, 5))
        yield (np.int64(prefill), np.int64(decodes * width), np.int64(rng.integers(1, 3)),
               np.int64(decodes), np.bool_(False))


@pytest.mark.parametrize("name", sorted(TAKEN) + ["mla", "sliding window", "dcp"])
def test_count_pieces_read_off_a_block_are_the_steps_own(name):
    model = _model({**TAKEN, **LEFT}[name])
    blocks = model.count_blocks
    for counts in _chunk_step_counts(np.random.default_rng(3), model.width):
        assert blocks.takes(False, counts)
        read = blocks.pieces(*counts)
        model.count_blocks = None
        own = model._count_pieces(False, *counts)
        model.count_blocks = blocks
        assert _numbers(read) == _numbers(own), (name, counts)
    assert len(blocks._blocks) < 40  # blocks were shared


@pytest.mark.parametrize("name", sorted(TAKEN))
def test_numbers_rows_read_off_a_block_are_the_steps_own(name):
    # what the compiled loop reads for a step with a chunk: its block's row of numbers
    model = _model(TAKEN[name])
    rows, blocks = model.compiled_rows, model.count_blocks
    for counts in _chunk_step_counts(np.random.default_rng(4), model.width):
        got = blocks.numbers(counts, rows._count_numbers)
        model.count_blocks = None
        own = rows._count_numbers(model._count_pieces(False, *counts))
        model.count_blocks = blocks
        assert got is not None and got.shape == own.shape == (1, own.shape[1])
        assert got.tobytes() == own.tobytes(), (name, counts)
    assert len(blocks._blocks) < 40  # blocks were shared


def test_counts_of_a_pipeline_or_lockstep_ranks_have_no_blocks():
    assert _model(LEFT["pipeline"]).count_blocks is None
    counts = (np.int64(100), np.int64(1), np.int64(1), np.int64(1), np.bool_(False))
    blocks = _model(TAKEN["dense dp2"]).count_blocks
    assert blocks.takes(False, counts) and not blocks.takes(True, counts)
    assert not blocks.takes(False, (np.float64(100), *counts[1:]))  # shares: float counts
    assert not blocks.takes(False, (np.int64(0), *counts[1:]))  # no chunk


@pytest.mark.parametrize("name", sorted(LEFT))
def test_models_it_cannot_price_keep_the_numpy_path(name):
    assert _model(LEFT[name]).compiled_rows is None


def test_without_the_memo_there_are_no_compiled_rows_nor_blocks():
    model = _model(TAKEN["dense dp2"], memoize=False)
    assert model.compiled_rows is None and model.count_blocks is None
