"""transformers is the oracle: a Hugging Face checkpoint, loaded by labkit from its folder
alone, computes what transformers computes.

For every family, a tiny HF model with HF's own default features on (and the RoPE
scaling of a real checkpoint of the family) is built from its config, reseeded, saved
with `save_pretrained`; labkit reads the folder's config.json (`Engine(model=folder)`)
and its safetensors (`checkpoint=folder`). The requests of the layouts test (a shared
prefix later requests hit in the prefix cache, prompts chunked by a small token
budget, speculative decoding with two n-gram drafts) run on one device and under
multi-rank layouts; every request's tokens must be transformers' greedy tokens, and
every logits row within 1e-5 relative error of transformers' whole-sequence forward
pass (float32).
"""

from __future__ import annotations

import pytest
import torch
from compute_cases import (
    REL_TOL, compute_engine, logits_by_row, max_rel_error, run_to_end, shared_prefix_prompts,
    submit_prompts)
from hf_oracle import hf_logits, load_hf, save_hf

pytest.importorskip("transformers")

LAYOUTS = {
    "llama": ["tp1", "tp2", "tp4xdcp2", "pcp2", "pp2"],
    "qwen3-moe": ["tp1", "tp2", "tp2xep2", "dep2", "pcp2", "pp2"],
    "deepseek-v3": ["tp1", "tp2", "dcp2", "pcp2xdcp2", "tp2xep2", "dep2", "pp2"],
    "deepseek-v3.2": ["tp1", "tp2", "dcp2", "pcp2xdcp2", "dep2", "pp2"],
    "kimi-linear": ["tp1", "tp2", "dcp2", "pcp2", "dep2", "pp2"],
    "gpt-oss": ["tp1", "tp2", "tp2xep2", "dep2", "pp2"],  # (windows: no DCP, no PCP)
}
CASES = [(f, lo) for f, layouts in LAYOUTS.items() for lo in layouts]
MAX_TOKENS = 8

_saved: dict = {}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    def folder(family: str):
        if family not in _saved:
            path = save_hf(family, tmp_path_factory.mktemp(family.replace(".", "")))
            _saved[family] = (path, load_hf(path))
        return _saved[family]
    return folder


def run(folder, layout: str):
    eng = compute_engine(str(folder), layout, checkpoint=str(folder), block_size=16,
                         num_speculative_tokens=2, max_num_batched_tokens=32)
    prompts = shared_prefix_prompts(eng.model.vocab_size)
    submit_prompts(eng, prompts, max_tokens=MAX_TOKENS)
    return run_to_end(eng), prompts


@pytest.mark.parametrize("family,layout", CASES)
def test_hf_checkpoint_computes_what_transformers_computes(hf_dir, family, layout):
    folder, model = hf_dir(family)
    eng, prompts = run(folder, layout)
    latest = {}
    for (rid, pos, _), row in logits_by_row(eng).items():
        latest[(rid, pos)] = row  # the last computation of a position is the accepted one
    worst = 0.0
    for rid, prompt in prompts.items():
        out = eng.requests[rid].output_token_ids
        ref = hf_logits(model, prompt + out[:-1])
        # greedy: every generated token is transformers' argmax after the ones before it
        # (a causal forward pass over the final stream gives each of those steps)
        assert len(out) == MAX_TOKENS
        assert ref[len(prompt) - 1:].argmax(-1).tolist() == out, f"{family} {layout} {rid}"
        rows = {pos: row for (r, pos), row in latest.items() if r == rid and pos < len(ref)}
        assert len(rows) >= MAX_TOKENS
        worst = max([worst] + [max_rel_error(row, ref[pos]) for pos, row in rows.items()])
    print(f"ORACLE {family} {layout} max_rel_logit_error={worst:.2e}")
    assert worst < REL_TOL, f"{family} {layout}: max relative error {worst:.2e}"


def test_deepseek_checkpoint_without_mtp_loads_and_mtp_module_is_all_or_nothing(hf_dir,
                                                                                 tmp_path):
    """transformers saves no MTP layer although config.json says num_nextn_predict_layers
    = 1: the checkpoint loads; a checkpoint with only part of a module is refused."""
    from safetensors.torch import load_file, save_file

    from labkit.engine.compute.models import CheckpointError, load_safetensors
    from labkit.specs import get_model
    folder, _ = hf_dir("deepseek-v3")
    spec = get_model(str(folder))
    assert spec.num_mtp_modules == 1
    weights = load_safetensors(folder, spec)
    assert not any(n.startswith(f"model.layers.{spec.num_layers}.") for n in weights)
    tensors = load_file(str(next(folder.glob("*.safetensors"))))
    tensors[f"model.layers.{spec.num_layers}.enorm.weight"] = torch.ones(spec.hidden_size)
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing"):
        load_safetensors(tmp_path, get_model(str(tmp_path)))
