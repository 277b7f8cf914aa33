"""The step model prices each step from its own row of the work alone: a run of k
steps priced at once ((k, ranks) arrays, as fast-forward asks) equals its steps priced
one by one, bit for bit, with the memo on (a run's uniform counts priced as one row and
broadcast, `LayerStepModel._counts`) and off. Also: prefill chunks summed per rank as a
plain loop sums them."""

import numpy as np
import pytest

from labkit.costmodel import CostModel
from labkit.engine.capacity import placement_for
from labkit.engine.sim.attention_cost import sum_chunks
from labkit.engine.sim.layer_model import LayerStepModel
from labkit.engine.step_work import StepWork
from labkit.specs import EngineConfig, Layout, get_model

CONFIGS = {  # model, layout, drafts, lockstep
    "dp2": ("tiny-llama", "dp2", 0, False),
    "dep4 spec decode": ("tiny-qwen3-moe", "dep4", 2, True),
    "sliding window": ("tiny-gpt-oss", "tp1", 0, False),
    "pipeline": ("tiny-llama", "tp2xpp2", 0, False),
    "mla dcp": ("tiny-deepseek-v3", "dcp2", 0, False),
    "moe dp2": ("tiny-qwen3-moe", "dp2", 0, False),
}
FIELDS = ("prefill_tokens", "decode_tokens", "num_prefill_reqs", "num_decode_reqs",
          "kv_read_tokens", "prefill_pairs", "decode_pairs", "idle", "decode_context")


def _model(name: str, memoize: bool) -> tuple[LayerStepModel, bool]:
    model, layout, drafts, lockstep = CONFIGS[name]
    config = EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048,
                          num_speculative_tokens=drafts, sim_step_cache=memoize)
    m = LayerStepModel.from_config(placement_for(get_model(model), Layout.parse(layout),
                                                 config), CostModel("h100"), config)
    return m, lockstep


def _run(rng, k: int, ranks: int, width: int, uniform: bool) -> StepWork:
    """k decode steps: counts the same in every step (a run) or not; contexts grow."""
    reqs = rng.integers(0, 9, size=(1 if uniform else k, ranks))
    reqs = np.broadcast_to(reqs, (k, ranks)).copy()
    reqs[:, 0] += reqs.sum(axis=1) == 0  # a run's step decodes somewhere (else DCP's
    # collectives, sized on whether any step of the array has queries, would differ)
    context = rng.integers(0, 5000, size=(1, ranks)) * reqs \
        + np.cumsum(reqs * width, axis=0)
    tokens = reqs * width
    return StepWork(np.zeros_like(reqs), tokens, np.zeros_like(reqs), reqs,
                    context + tokens, np.zeros_like(reqs), tokens * context, reqs == 0,
                    decode_context=context)


def _row(work: StepWork, i: int) -> StepWork:
    return StepWork(*(getattr(work, f)[i:i + 1] for f in FIELDS))


def _same(a, b) -> bool:
    return all(np.asarray(x).dtype == np.asarray(y).dtype and
               np.asarray(x).shape == np.asarray(y).shape and
               np.asarray(x).tobytes() == np.asarray(y).tobytes()
               for x, y in zip((a.busy, a.compute, a.comm, a.duration, a.temporary_kv_bytes),
                               (b.busy, b.compute, b.comm, b.duration, b.temporary_kv_bytes)))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_run_equals_its_steps_one_by_one(name):
    rng = np.random.default_rng(7)
    ranks = Layout.parse(CONFIGS[name][1]).dp
    width = 1 + CONFIGS[name][2]
    for trial in range(12):
        work = _run(rng, int(rng.integers(2, 40)), ranks, width, uniform=trial % 3 != 0)
        for memoize in (True, False):
            m, lockstep = _model(name, memoize)
            whole = m.step_timing(work, lockstep)
            one, _ = _model(name, memoize)  # a fresh memo: rows priced on their own
            for i in range(work.decode_tokens.shape[0]):
                row = one.step_timing(_row(work, i), lockstep)
                assert _same(row, type(row)(*(x[i:i + 1] for x in (
                    whole.busy, whole.compute, whole.comm, whole.duration,
                    whole.temporary_kv_bytes)))), (name, trial, memoize, i)
            assert _same(whole, _model(name, not memoize)[0].step_timing(work, lockstep))


def test_chunks_summed_per_rank_in_order():
    rng = np.random.default_rng(3)
    for _ in range(200):
        ranks, n = int(rng.integers(1, 6)), int(rng.integers(1, 12))
        rank = rng.integers(0, ranks, size=n)
        seconds = rng.random(n) * 10.0 ** rng.integers(-6, 0, size=n)
        share = rng.choice([1.0, 3.0])
        work = StepWork(*(np.zeros((1, ranks), dtype=np.int64) for _ in range(8)),
                        prefill_chunks=(rank, None, None, np.zeros_like(rank)),
                        chunk_share=share)
        want = np.zeros(ranks)
        for r, s in zip(rank, seconds):  # in chunk order, as np.add.at adds them
            want[r] += s
        assert sum_chunks(work, seconds).tobytes() == (want[None, :] / share).tobytes()


def _entries(rng, k: int, ranks: int, width: int):
    """A run's entries with prefill chunks: requests by rank, each step a request
    decodes `width` tokens, computes a chunk, or sits the step out."""
    n = int(rng.integers(1, 4 * ranks + 1))
    rank_of = np.sort(rng.integers(0, ranks, size=n))
    kind = rng.choice(3, size=(n, k), p=[0.6, 0.3, 0.1])  # decode / chunk / out
    new = np.where(kind == 0, width, np.where(kind == 1, rng.integers(1, 600, (n, k)), 0))
    context = rng.integers(0, 9000, size=(n, 1)) + np.cumsum(new, axis=1) - new
    return rank_of, context, new, kind == 1


def _batches(rank_of, ranks: int, context, new, prefill, j: int) -> list:
    """Step j as the ranks' RankBatch objects, requests in order (as a single step
    lists them)."""
    from labkit.engine.scheduler import RankBatch

    batches = [RankBatch(r) for r in range(ranks)]
    for i, r in enumerate(rank_of.tolist()):
        if new[i, j]:
            b = batches[r]
            b.requests.append(i)
            b.num_new_tokens.append(int(new[i, j]))
            b.contexts.append(int(context[i, j]))
            b.is_decode.append(not prefill[i, j])
    return batches


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_run_with_prefill_chunks_equals_its_steps(name):
    """StepWork.from_entries row j == StepWork.from_batches of step j's batches, and the
    run priced at once == its steps priced one by one (memo on and off)."""
    rng = np.random.default_rng(11)
    if not _model(name, True)[0].prices_chunk_rows:  # (DCP: such runs are declined)
        assert name == "mla dcp"
        return
    ranks = Layout.parse(CONFIGS[name][1]).dp
    width = 1 + CONFIGS[name][2]
    for trial in range(8):
        k = int(rng.integers(2, 12))
        rank_of, context, new, prefill = _entries(rng, k, ranks, width)
        work = StepWork.from_entries(rank_of, ranks, context, new, prefill)
        steps = [StepWork.from_batches(_batches(rank_of, ranks, context, new, prefill, j))
                 for j in range(k)]
        for j, step in enumerate(steps):
            row = work.rows(j, j + 1)
            for f in FIELDS:
                assert np.array_equal(getattr(row, f), getattr(step, f)), (f, j)
            for a, b in zip(row.prefill_chunks, step.prefill_chunks):
                assert a.tolist() == b.tolist()
        for memoize in (True, False):
            m, lockstep = _model(name, memoize)
            whole = m.step_timing(work, lockstep)
            for j, step in enumerate(steps):
                one = _model(name, memoize)[0].step_timing(step, lockstep)
                assert _same(one, type(one)(*(x[j:j + 1] for x in (
                    whole.busy, whole.compute, whole.comm, whole.duration,
                    whole.temporary_kv_bytes)))), (name, trial, memoize, j)
