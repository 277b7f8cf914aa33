"""Reference models of every tiny preset: sane, causal, and consistent across dtypes."""

import pytest
import torch

from labkit.engine.compute.models import (
    init_weights, reference_greedy, reference_logits, reference_mtp_logits)
from labkit.specs.model_presets import MODEL_PRESETS, get_model

TINY = [n for n in MODEL_PRESETS if n.startswith("tiny-")]
F64 = torch.float64




def _prompt(spec, T, seed=0):
    return torch.randint(0, spec.vocab_size, (T,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", TINY)
def test_tiny_presets_give_finite_logits_and_varied_greedy_tokens(name):
    spec = get_model(name)
    w = init_weights(spec)
    ids = _prompt(spec, 24)
    logits = reference_logits(spec, w, ids)
    assert logits.shape == (24, spec.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert 0.3 < logits.std().item() < 3  # well conditioned: neither flat nor saturated
    out = reference_greedy(spec, w, ids[:8], 12)
    assert len(set(out)) > 3, out


@pytest.mark.parametrize("name", TINY)
def test_prefix_logits_do_not_change_when_tokens_are_appended(name):
    spec = get_model(name)
    w = init_weights(spec, seed=1, dtype=F64)
    ids = _prompt(spec, 40, seed=2)
    full = reference_logits(spec, w, ids)
    for cut in (1, 17, 33):
        torch.testing.assert_close(reference_logits(spec, w, ids[:cut]), full[:cut],
                                   rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", TINY)
def test_float32_tracks_float64(name):
    spec = get_model(name)
    w = init_weights(spec)
    ids = _prompt(spec, 20, seed=3)
    lo = reference_logits(spec, w, ids)
    hi = reference_logits(spec, w, ids, dtype=F64)
    assert hi.dtype == F64
    torch.testing.assert_close(lo.double(), hi, rtol=1e-4, atol=1e-4)


def test_dsa_model_equals_dense_mla_until_topk_bites():
    v32, v3 = get_model("tiny-deepseek-v3.2"), get_model("tiny-deepseek-v3")
    topk = v32.index_topk
    w32 = init_weights(v32, dtype=F64)
    w3 = {n: t for n, t in w32.items() if ".indexer." not in n}  # same names, same values
    ids = _prompt(v32, topk + 16, seed=4)
    a, b = reference_logits(v32, w32, ids), reference_logits(v3, w3, ids)
    torch.testing.assert_close(a[:topk], b[:topk], rtol=1e-10, atol=1e-10)
    assert (a[topk:] - b[topk:]).abs().max() > 1e-3  # sparse attention does change the rest


@pytest.mark.parametrize("name", ["tiny-deepseek-v3", "tiny-deepseek-v3.2"])
def test_mtp_logits(name):
    spec = get_model(name)
    w = init_weights(spec, dtype=F64)
    ids = _prompt(spec, 18, seed=5)
    (mtp,) = reference_mtp_logits(spec, w, ids)
    assert mtp.shape == (17, spec.vocab_size) and torch.isfinite(mtp).all()
    # row i drafts token i + 2 from tokens <= i + 1: causal
    (short,) = reference_mtp_logits(spec, w, ids[:10])
    torch.testing.assert_close(short, mtp[:9], rtol=1e-10, atol=1e-10)
    assert not torch.allclose(mtp, reference_logits(spec, w, ids)[1:])


def test_models_without_mtp_have_no_mtp_logits():
    spec = get_model("tiny-llama")
    assert reference_mtp_logits(spec, init_weights(spec), _prompt(spec, 5)) == []


@pytest.mark.parametrize("name", TINY)
def test_bfloat16_runs(name):
    spec = get_model(name)
    logits = reference_logits(spec, init_weights(spec), _prompt(spec, 12), dtype=torch.bfloat16)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


ODD_SPECS = {
    # the indexer reads the hidden state when there is no q_lora
    "tiny-deepseek-v3.2": dict(q_lora_rank=0, index_topk=5),
    # no short conv, tied embeddings, MHA-like GQA elsewhere
    "tiny-kimi-linear": dict(linear_conv_kernel=0, tie_word_embeddings=True, first_k_dense=0),
    "tiny-llama": dict(num_kv_heads=4, tie_word_embeddings=True, num_layers=1),
    "tiny-qwen3-moe": dict(num_experts_per_tok=1, first_k_dense=1),
}


@pytest.mark.parametrize("name", list(ODD_SPECS))
def test_any_spec_variant_runs_and_stays_causal(name):
    from dataclasses import replace

    spec = replace(get_model(name), name="odd", **ODD_SPECS[name])
    w = init_weights(spec, dtype=F64)
    ids = _prompt(spec, 14, seed=6)
    full = reference_logits(spec, w, ids)
    assert torch.isfinite(full).all()
    torch.testing.assert_close(reference_logits(spec, w, ids[:9]), full[:9], rtol=1e-10, atol=1e-10)
