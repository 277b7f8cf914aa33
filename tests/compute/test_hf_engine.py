"""A Hugging Face folder as the model, without a preset: the engine, the CLI, text prompts.

`Engine(model=folder, backend="compute", checkpoint=folder)` and `labkit replay --model
folder --checkpoint folder` run a model from its config.json and safetensors alone;
the simulation takes `--model folder` too. A tokenizer beside the config makes prompts
text. A checkpoint whose config.json describes another function than the model it is
loaded into is refused, naming the keys.
"""

from __future__ import annotations

import json

import pytest
from compute_cases import run_to_end
from hf_oracle import hf_greedy, load_hf, save_hf

from labkit.cli import main
from labkit.engine.compute.models import CheckpointError
from labkit.engine.engine import Engine
from labkit.errors import ConfigError

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_hf("llama", tmp_path_factory.mktemp("hf-llama"))


def _word_tokenizer(folder, vocab_size: int) -> None:
    """A word-level tokenizer of `vocab_size` words w0 .. w{n-1}, built locally."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {f"w{i}": i for i in range(vocab_size - 1)} | {"[UNK]": vocab_size - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))


def test_text_prompts_through_the_folders_tokenizer(llama_dir, tmp_path):
    folder = tmp_path / "with-tokenizer"
    folder.mkdir()
    for f in llama_dir.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    _word_tokenizer(folder, 512)
    eng = Engine(model=str(folder), backend="compute", checkpoint=str(folder), block_size=16)
    text = "w5 w17 w300 w42 w42 w9 w511"  # w511 is not a word: [UNK] = 511
    req = eng.submit_prompt(text, 6)
    run_to_end(eng)
    assert req.prompt_token_ids == [5, 17, 300, 42, 42, 9, 511]
    assert req.output_token_ids == hf_greedy(load_hf(folder), req.prompt_token_ids, 6)
    words = eng.tokenizer.decode(req.output_token_ids).split()
    assert words == [f"w{t}" if t < 511 else "[UNK]" for t in req.output_token_ids]


def test_text_prompt_without_a_tokenizer_is_an_error(llama_dir):
    eng = Engine(model=str(llama_dir), backend="compute", checkpoint=str(llama_dir))
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        eng.submit_prompt("hello", 4)


def test_a_checkpoint_whose_config_describes_another_model_is_refused(tmp_path):
    """The issue's case: a Qwen3-MoE checkpoint saved with norm_topk_prob=false (HF's
    default) must not load silently under a preset that renormalises."""
    folder = save_hf("qwen3-moe", tmp_path / "qwen")
    assert json.loads((folder / "config.json").read_text())["norm_topk_prob"] is False
    with pytest.raises(CheckpointError, match="norm_topk_prob False != True"):
        Engine(model="tiny-qwen3-moe", backend="compute", checkpoint=str(folder))


def test_replay_cli_with_an_hf_folder_as_the_model(capsys, llama_dir, tmp_path):
    trace = tmp_path / "tiny.jsonl"
    assert main(["trace", "gen", "--sessions", "2", "--seed", "1", "--tiny",
                 "--out", str(trace)]) == 0
    common = ["replay", "--trace", str(trace), "--model", str(llama_dir), "--concurrency",
              "2", "--no-loop-trace", "--max-idle-s", "1", "--json", "--no-progress"]
    capsys.readouterr()
    assert main(common + ["--backend", "compute", "--checkpoint", str(llama_dir),
                          "--clock", "predicted", "--layout", "tp2"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["backend"] == "compute" and summary["requests_completed"] >= 4
    assert summary["model"] == llama_dir.name
    assert main(common) == 0  # the simulation, from the same config.json
    assert json.loads(capsys.readouterr().out)["requests_completed"] >= 4
