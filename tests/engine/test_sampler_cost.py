"""The sampler's share of a step (`engine/sim/sampler_cost.py`): every sampled row
streams the whole vocabulary through HBM, pass by pass, so a step costs rows x vocab x
bytes / bandwidth more with top-k / top-p than greedy -- the same on every TP rank
(the LM head's shards are gathered before sampling), four times more for a vocabulary
four times larger. And on the measured runs: a held-out Llama-3.1-8B run (128K
vocabulary) comes closer to its measured TPOT with the sampler its server ran than with
none."""

import dataclasses

import numpy as np
import pytest
from support import SHARED_DATA

from labkit.costmodel import CostModel
from labkit.engine.capacity import placement_for
from labkit.engine.sim.layer_model import LayerStepModel
from labkit.engine.sim.sampler_cost import SAMPLER_BYTES, SAMPLER_HBM_EFFICIENCY
from labkit.engine.step_work import StepWork
from labkit.errors import ConfigError
from labkit.specs import EngineConfig, Layout, get_hardware, get_model


def _compute_s(model, layout: str, sampling: str, decodes: int, prompt: int = 0) -> float:
    """GPU seconds of one step (kernels only): `decodes` requests decoding at 1,000
    tokens of context, and a prompt's chunk of `prompt` tokens if any."""
    placement = placement_for(model, Layout.parse(layout), EngineConfig())
    step_model = LayerStepModel(placement, CostModel("h100"), 0, sampling=sampling)
    n = decodes + (prompt > 0)
    new = np.array([[1]] * decodes + ([[prompt]] if prompt else []))
    prefill = np.array([[False]] * decodes + ([[True]] if prompt else []))
    work = StepWork.from_entries(np.zeros(n, dtype=np.int64), 1, np.full((n, 1), 1000), new,
                                 prefill)
    return float(step_model.step_timing(work, False).compute[0, 0])


def _extra_s(vocab: int, rows: int, sampling: str) -> float:
    bandwidth = get_hardware("h100").hbm_bandwidth * SAMPLER_HBM_EFFICIENCY
    return rows * vocab * SAMPLER_BYTES[sampling] / bandwidth


@pytest.mark.parametrize("layout", ["tp1", "tp2"])
def test_top_p_costs_its_passes_over_every_rows_whole_vocabulary(layout):
    model = get_model("llama-3.1-8b")
    for rows in (1, 64):
        greedy = _compute_s(model, layout, "greedy", rows)
        for sampling in ("random", "top_p"):
            more = _compute_s(model, layout, sampling, rows) - greedy
            want = _extra_s(model.vocab_size, rows, sampling) - \
                _extra_s(model.vocab_size, rows, "greedy")
            assert more == pytest.approx(want, rel=1e-9)  # not divided by TP
    # a prompt's chunk is one sampled row, however long
    chunk = _compute_s(model, "tp1", "top_p", 3, prompt=700) - \
        _compute_s(model, "tp1", "greedy", 3, prompt=700)
    assert chunk == pytest.approx(4 * (_extra_s(model.vocab_size, 1, "top_p")
                                       - _extra_s(model.vocab_size, 1, "greedy")), rel=1e-9)


def test_sampling_grows_with_the_vocabulary_not_the_model():
    """Two models alike but for their vocabulary: the LM head and the sampler grow with
    it; top_p's extra time over greedy grows exactly 4x for a vocabulary 4x larger."""
    base = get_model("llama-3.1-8b")
    small = dataclasses.replace(base, vocab_size=32_000)
    large = dataclasses.replace(base, vocab_size=128_000)
    gap = {m.vocab_size: _compute_s(m, "tp1", "top_p", 64) - _compute_s(m, "tp1", "greedy", 64)
           for m in (small, large)}
    assert gap[128_000] == pytest.approx(4 * gap[32_000], rel=1e-9)
    # and it matters: at 64 rows of 128K entries it is a few percent of a decode step
    share = gap[128_000] / _compute_s(large, "tp1", "top_p", 64)
    assert 0.02 < share < 0.15


def test_unknown_sampling_is_refused():
    with pytest.raises(ConfigError, match="sampling.*top_p"):
        EngineConfig(sampling="nucleus")
    placement = placement_for(get_model("tiny-llama"), Layout.parse("tp1"), EngineConfig())
    with pytest.raises(ConfigError, match="allowed: top_p, random, greedy"):
        LayerStepModel(placement, CostModel("h100"), 0, sampling="beam")


E2E = SHARED_DATA / "e2e" / "blis_h100_vllm"


@pytest.mark.skipif(not E2E.is_dir(), reason=f"measured runs not found at {E2E}")
def test_a_large_vocabulary_held_out_run_needs_its_sampler():
    """Llama-3.1-8B general (held out: the overheads never saw it), replayed at a fiftieth
    of its duration: its server sampled with top_p (the model's generation_config), and
    the simulated TPOT with that sampler is closer to the measured one than with
    greedy sampling, which leaves it too fast."""
    from labkit.validate.runs import load_runs
    from labkit.validate.simulate import simulate_run

    runs = load_runs(SHARED_DATA).set_index("id")
    run = runs.loc["16-llama-3-1-8b-tp1-general-1"].copy()
    assert run["part"] == "held_out"
    error = {}
    for sampling in ("greedy", "top_p"):
        run["knobs"] = {**run["knobs"], "sampling": sampling}
        error[sampling] = simulate_run(run, 0.02)["tpot"] / run["tpot"] - 1
    assert error["greedy"] < error["top_p"] < 0.05
    assert abs(error["top_p"]) < abs(error["greedy"])
