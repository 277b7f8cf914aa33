"""The step model's fast paths price a step exactly as its plain path does, bit for bit.

With the memo on (`sim_step_cache`, the default) a step's count-only pieces are priced
once per distinct counts, on one row of them when a run's rows share their counts, and
as numpy scalars when that row is one rank's (`LayerStepModel._counts`); one step of
one rank prices its decode core as a number. With the memo off every piece is priced on
the whole (steps, ranks) arrays. Both go through the trusted `CostModel` (no size
checks), which must equal the checked one. Random steps — prefill and decode mixes,
idle ranks, decode-only runs — on layouts that exercise every branch (one rank, DP,
TP, EP in lockstep with drafts, skewed routing with EPLB, sliding windows, pipeline
stages, MLA with DCP, DSA, linear attention, PCP, PCPxDCP, KVPP, eager and synchronous
scheduling): the fast path's five arrays equal the plain path's, and each step priced
alone equals its row of the run."""

import numpy as np
import pytest

from labkit.costmodel import CostModel
from labkit.engine.capacity import placement_for
from labkit.engine.sim.layer_model import LayerStepModel
from labkit.engine.step_work import StepWork
from labkit.specs import EngineConfig, Layout, get_model

CONFIGS = {  # model, layout, drafts, lockstep, engine knobs
    "one rank": ("tiny-llama", "tp1", 0, False, {}),
    "dp2": ("tiny-llama", "dp2", 0, False, {}),
    "tp2": ("tiny-llama", "tp2", 0, False, {}),
    "dep4 lockstep, drafts": ("tiny-qwen3-moe", "dep4", 2, True, {}),
    "dep4 not lockstep": ("tiny-qwen3-moe", "dep4", 0, False, {}),
    "moe skewed, eplb": ("tiny-deepseek-v3", "dep4", 0, True,
                         dict(moe_routing="power_law_1.2", enable_eplb=True,
                              num_redundant_experts=4)),
    "moe tp2xep2 one rank": ("tiny-qwen3-moe", "tp2xep2", 0, False,
                             dict(moe_routing="power_law_1.01")),
    "sliding window": ("tiny-gpt-oss", "tp1", 0, False, {}),
    "pipeline": ("tiny-llama", "tp2xpp2", 0, False, {}),
    "mla dcp": ("tiny-deepseek-v3", "dcp2", 1, False, {}),
    "dsa": ("tiny-deepseek-v3.2", "tp1", 0, False, {}),
    "dsa dcp": ("tiny-deepseek-v3.2", "dcp2", 0, False, {}),
    "linear attention": ("tiny-kimi-linear", "tp1", 0, False, {}),
    "pcp": ("tiny-llama", "pcp2", 0, False, {}),
    "pcp x dcp": ("tiny-llama", "pcp2xdcp2", 0, False, {}),
    "kvpp": ("tiny-deepseek-v3", "tp2xkvpp2", 0, False, {}),
    "eager, synchronous": ("tiny-llama", "dp2", 0, False,
                           dict(cudagraph_mode="NONE", async_scheduling=False)),
    "no overheads": ("tiny-qwen3-moe", "tp1", 0, False, None),
}
FIELDS = ("busy", "compute", "comm", "duration", "temporary_kv_bytes")


def _model(name: str, memoize: bool, ops: CostModel | None = None) -> LayerStepModel:
    model, layout, drafts, _, knobs = CONFIGS[name]
    config = EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048,
                          num_speculative_tokens=drafts, sim_step_cache=memoize,
                          **(knobs or {}))
    placement = placement_for(get_model(model), Layout.parse(layout), config)
    ops = ops or CostModel("h100")
    if knobs is None:  # kernels only: no graphs, no CPU
        return LayerStepModel(placement, ops, drafts, memoize=memoize)
    return LayerStepModel.from_config(placement, ops, config)


def _work(rng, ranks: int, width: int, kind: str) -> StepWork:
    """k steps of random requests: a decode-only run (the same requests every step,
    contexts growing), or any mix of prefill chunks, decodes and idle ranks."""
    k = int(rng.integers(1, 7))
    n = int(rng.integers(1, 3 * ranks + 1))
    rank_of = np.sort(rng.integers(0, ranks, size=n))
    if kind == "decode run":
        new = np.full((n, k), width)
        prefill = np.zeros((n, k), dtype=bool)
    else:
        what = rng.choice(3, size=(n, k), p=[0.5, 0.3, 0.2])  # decode / chunk / out
        new = np.where(what == 0, width, np.where(what == 1, rng.integers(1, 900, (n, k)), 0))
        prefill = what == 1
    context = rng.integers(0, 20000, size=(n, 1)) + np.cumsum(new, axis=1) - new
    return StepWork.from_entries(rank_of, ranks, context, new, prefill)


def _bits(timing) -> list:
    return [(np.asarray(x).dtype, np.asarray(x).shape, np.asarray(x).tobytes())
            for x in (getattr(timing, f) for f in FIELDS)]


def _flat(pieces) -> list:
    """Every number in (nested) pieces, as float64 bytes: a scalar and its 1x1 array
    alike."""
    if isinstance(pieces, tuple):
        return [x for p in pieces for x in _flat(p)]
    return [None if pieces is None else np.asarray(pieces, dtype=np.float64).tobytes()]


def _row(timing, j: int) -> list:
    return _bits(type(timing)(*(getattr(timing, f)[j:j + 1] for f in FIELDS)))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fast_path_equals_plain_path(name):
    rng = np.random.default_rng(sum(map(ord, name)))
    _, layout, drafts, lockstep, _ = CONFIGS[name]
    ranks = Layout.parse(layout).dp
    fast, plain = _model(name, True), _model(name, False)
    for trial in range(24):
        kind = "decode run" if trial % 2 else "mix"
        if kind == "mix" and not fast.prices_chunk_rows:
            # (DCP, PCP, KVPP: a run's collectives are sized on all its rows, so runs
            # with chunks are never priced at once; single steps are)
            work = _work(rng, ranks, 1 + drafts, kind).head(1)
        else:
            work = _work(rng, ranks, 1 + drafts, kind)
        whole = fast.step_timing(work, lockstep)  # the memo warm from earlier trials
        assert _bits(whole) == _bits(plain.step_timing(work, lockstep)), (name, trial)
        # the count pieces themselves (the sums above may round a last-bit slip away):
        # as the fast path forms them (scalars for one rank) and on the arrays
        first = work.rows(0, 1)
        assert _flat(fast._count_pieces(lockstep, *fast._counts(first, lockstep))) == \
            _flat(plain._count_pieces(lockstep, *plain._counts(first, lockstep))), name
        for j in range(work.decode_tokens.shape[0]):
            alone = _model(name, True).step_timing(work.rows(j, j + 1), lockstep)
            assert _bits(alone) == _row(whole, j), (name, trial, j)


def test_trusted_cost_model_equals_checked():
    """The step model's unchecked CostModel prices exactly as the checked one, and the
    checked one still refuses a negative size."""
    rng = np.random.default_rng(5)
    checked = CostModel("h200")
    trusted = checked.trusted()
    m = rng.integers(0, 5000, size=(7, 3))
    calls = [
        ("gemm", (m, 4096, 2048, "fp8")), ("gemm", (17, 7168.0, 512, "bf16")),
        ("attention_decode", (np.maximum(m, 1), m * 3.5, 32.0, 4, 128, "fp8")),
        ("attention_prefill", (1, m + 1, m * 2, 16.0, 8, 128)),
        ("mla_decode", (np.maximum(m, 1), m * 7.0, 16.0, 512, 64, "bf16", 3)),
        ("mla_prefill", (1, m + 1, m, 16.0)),
        ("sparse_attention", (2, 3, np.minimum(m, 2048) + 1, 16.0)),
        ("indexer", (2, 3, m + 1.0)),
        ("moe", (m, 2048, 768, 8, 128, 4, 1, "fp8_block", "power_law_1.2", 1.7)),
        ("collective", ("all_reduce", m * 4096.0, 8)), ("collective", ("all_to_all", m, 16)),
        ("p2p", (m * 2.0, "ib")),
    ]
    for op, args in calls:
        a, b = getattr(checked, op)(*args), getattr(trusted, op)(*args)
        assert type(a) is type(b) and np.asarray(a).tobytes() == np.asarray(b).tobytes(), op
    scalar = trusted.gemm(3, 4096, 2048)
    assert type(scalar) is float and scalar == checked.gemm(3, 4096, 2048)
    with pytest.raises(Exception, match="sizes must be finite numbers >= 0"):
        checked.gemm(-1, 4096, 2048)
