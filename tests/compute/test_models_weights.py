"""Seeded weights, their names and shapes, TP slices, and the safetensors loader."""

import pytest
import torch

from labkit.engine.compute.models import (
    CheckpointError, init_weights, load_safetensors, reference_logits, weight_shapes)
from labkit.engine.compute.models.weights import init_tensor, name_seed
from labkit.specs.family import FAMILIES
from labkit.specs.model_presets import MODEL_PRESETS, get_model





def test_same_seed_identical_other_seed_differs():
    spec = get_model("tiny-kimi-linear")
    a, b, c = init_weights(spec, 0), init_weights(spec, 0), init_weights(spec, 1)
    assert list(a) == list(b) == list(c)
    assert all(torch.equal(a[n], b[n]) for n in a)
    random = [n for n in a if not torch.equal(a[n], torch.ones_like(a[n]))
              and not torch.equal(a[n], torch.zeros_like(a[n]))]
    assert random and all(not torch.equal(a[n], c[n]) for n in random)


def test_float64_weights_are_the_float32_ones_widened():
    spec = get_model("tiny-deepseek-v3")
    w32, w64 = init_weights(spec), init_weights(spec, dtype=torch.float64)
    assert all(w64[n].dtype == torch.float64 and torch.equal(w64[n], w32[n].double())
               for n in w32)


def test_tensor_seeds_are_stable_across_processes():
    # blake2b, not Python's salted hash(): these numbers never change.
    assert name_seed(0, "model.embed_tokens.weight") == name_seed(0, "model.embed_tokens.weight")
    assert name_seed(0, "a") != name_seed(1, "a") != name_seed(0, "b")
    t = init_tensor("model.layers.0.self_attn.q_proj.weight", (4, 8))
    assert torch.equal(t, init_tensor("model.layers.0.self_attn.q_proj.weight", (4, 8)))
    assert abs(t.std().item() - 8 ** -0.5) < 0.2


def test_names_follow_the_hugging_face_scheme():
    names = set(weight_shapes(get_model("tiny-llama")))
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
            "model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
            "model.layers.0.input_layernorm.weight"} <= names
    ds = weight_shapes(get_model("tiny-deepseek-v3.2"))
    assert ds["model.layers.0.self_attn.kv_b_proj.weight"] == (4 * (16 + 16), 32)
    assert "model.layers.0.mlp.gate_proj.weight" in ds  # first_k_dense
    assert ds["model.layers.1.mlp.experts.7.down_proj.weight"] == (64, 32)
    assert "model.layers.2.self_attn.indexer.wk.weight" in ds
    assert ds["model.layers.3.eh_proj.weight"] == (64, 128)  # the MTP module
    kimi = weight_shapes(get_model("tiny-kimi-linear"))
    assert "model.layers.0.self_attn.A_log" in kimi
    assert "model.layers.3.self_attn.q_proj.weight" in kimi
    assert "model.layers.3.self_attn.kv_b_proj.weight" in kimi


@pytest.mark.parametrize("name", [n for n, m in MODEL_PRESETS.items() if m.family in FAMILIES])
def test_matrix_params_match_the_spec_count(name):
    # Every matrix of the naming scheme, MTP included, adds up to ModelSpec's count
    # (which ignores norms, biases, convs and KDA's per-head scalars).
    spec = MODEL_PRESETS[name]
    shapes = weight_shapes(spec)
    matrices = sum(s[0] * s[1] for s in shapes.values() if len(s) == 2)
    assert matrices == spec.total_params(include_mtp=True)


# ------------------------------------------------------------------ safetensors
st = pytest.importorskip("safetensors.torch")


def _hf_llama(tmp_path, spec, shards=1):
    w = init_weights(spec, seed=3)
    names = list(w)
    for k in range(shards):
        part = {n: w[n].contiguous() for n in names[k::shards]}
        if k == 0:
            part["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # old HF buffer
        st.save_file(part, str(tmp_path / f"model-{k + 1:05d}-of-{shards:05d}.safetensors"))
    return w


def test_safetensors_round_trip(tmp_path):
    spec = get_model("tiny-llama")
    w = _hf_llama(tmp_path, spec, shards=2)
    loaded = load_safetensors(tmp_path, spec)
    assert set(loaded) == set(w) and all(torch.equal(loaded[n], w[n]) for n in w)
    ids = torch.arange(12) * 37 % spec.vocab_size
    assert torch.equal(reference_logits(spec, loaded, ids), reference_logits(spec, w, ids))
    one = tmp_path / "one.safetensors"
    st.save_file(w, str(one))
    assert load_safetensors(one, spec, dtype=torch.float64)["lm_head.weight"].dtype == torch.float64


def test_safetensors_errors_name_the_tensors(tmp_path):
    spec = get_model("tiny-llama")
    w = init_weights(spec)
    w.pop("model.layers.1.mlp.up_proj.weight")
    w["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 64)
    w["model.extra.weight"] = torch.zeros(2)
    st.save_file(w, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        load_safetensors(tmp_path, spec)
    msg = str(err.value)
    assert "missing (1): model.layers.1.mlp.up_proj.weight" in msg
    assert "unexpected (1): model.extra.weight" in msg
    assert "model.layers.0.self_attn.q_proj.weight (3, 64) != (64, 64)" in msg
    with pytest.raises(FileNotFoundError):
        load_safetensors(tmp_path / "nope", spec)
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_safetensors(_empty_dir(tmp_path), spec)


def _empty_dir(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    return d
