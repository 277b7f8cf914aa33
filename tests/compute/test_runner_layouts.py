"""Every layout computes what one device computes.

The same requests (a shared prefix that later requests hit in the prefix cache, prompts
chunked by a small token budget, speculative decoding with two n-gram drafts) run on
one GPU and on each layout; every logits row the runner produced must agree within
1e-5 relative error (float32), and the generated tokens must be identical. The
single-device run itself is checked against a whole-sequence recomputation.
"""

from __future__ import annotations

import pytest
from compute_cases import (
    REL_TOL, compute_engine, logits_by_row, max_rel_error, outputs, reference_rows,
    run_to_end, shared_prefix_prompts, submit_prompts)

from labkit.specs import get_model

LAYOUTS = {
    "tiny-llama": ["tp2", "tp4", "tp4xdcp2", "pcp2", "pcp2xdcp2", "tp2xpcp2xdcp2", "pp2",
                   "tp2xpp2", "dp2"],
    "tiny-qwen3-moe": ["tp2", "tp2xep2", "dep2", "dep4", "pcp2", "pp2"],
    "tiny-deepseek-v3": ["tp2", "tp4", "dcp2", "tp4xdcp4", "pcp2", "pcp2xdcp2",
                         "tp2xpcp2xdcp2", "tp2xep2", "dep2", "dep4", "dp2xtp2xep4", "pp2"],
    "tiny-deepseek-v3.2": ["tp2", "dcp2", "tp4xdcp4", "pcp2xdcp2", "dep2", "pp2"],
    "tiny-kimi-linear": ["tp2", "dcp2", "pcp2", "pcp2xdcp2", "dep2", "pp2"],
}
CASES = [(m, lo) for m, layouts in LAYOUTS.items() for lo in layouts]

_single: dict = {}


def scenario(model: str, layout: str, **knobs):
    eng = compute_engine(model, layout, num_speculative_tokens=2, max_num_batched_tokens=32,
                         **knobs)
    submit_prompts(eng, shared_prefix_prompts(get_model(model).vocab_size), max_tokens=8)
    return run_to_end(eng)


def single_device(model: str):
    if model not in _single:
        _single[model] = scenario(model, "tp1")
    return _single[model]


@pytest.mark.parametrize("model", list(LAYOUTS))
def test_single_device_matches_whole_sequence_recompute(model):
    eng = single_device(model)
    ref = reference_rows(model, eng)
    latest = {}
    for (rid, pos, _), row in logits_by_row(eng).items():
        latest[(rid, pos)] = row  # the last computation of a position is the accepted one
    checked = [max_rel_error(row, ref[key]) for key, row in latest.items() if key in ref]
    assert len(checked) >= 20
    assert max(checked) < REL_TOL
    assert sum(r.num_cached_tokens for r in eng.requests.values()) > 0


@pytest.mark.parametrize("model,layout", CASES)
def test_layout_matches_single_device(model, layout):
    base, eng = single_device(model), scenario(model, layout)
    want, got = logits_by_row(base), logits_by_row(eng)
    assert got.keys() == want.keys()
    worst = max(max_rel_error(got[k], want[k]) for k in want)
    assert worst < REL_TOL, f"{layout}: max relative error {worst:.2e}"
    assert outputs(eng) == outputs(base)
