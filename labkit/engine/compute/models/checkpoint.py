"""Loading a local Hugging Face safetensors checkpoint into labkit's weight names.

A checkpoint is one `*.safetensors` file or a folder of them, as `save_pretrained`
writes it. Its tensors are renamed to labkit's scheme (`hf_names.py`) and checked
against `weight_shapes(spec)` before anything is returned: a missing, unexpected or
wrongly shaped tensor raises `CheckpointError` naming them all. Multi-token-prediction
modules are optional (transformers does not save DeepSeek's MTP layer): a checkpoint
holds all of a module's tensors or none.

When the folder also holds a `config.json`, it must describe the model's function
(trivially so when the model was read from it): every shape and constant that differs
is named (a Qwen3 checkpoint saved with `norm_topk_prob=false` would otherwise
load silently under a preset that renormalises). Needs the `safetensors` package.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch

from labkit.engine.compute.models.family import family_config
from labkit.engine.compute.models.hf_names import to_labkit_names
from labkit.engine.compute.models.weights import weight_shapes
from labkit.errors import ConfigError
from labkit.specs.models import ModelSpec

# ModelSpec fields that are bookkeeping, not the function
_NOT_FUNCTION = {"name", "source", "constants", "max_model_len", "block_size", "weight_dtype",
                 "num_mtp_modules"}

_IGNORED = re.compile(r"rotary_emb\.inv_freq$")  # buffers some savers include


class CheckpointError(ConfigError):
    """A checkpoint that does not match its ModelSpec."""


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if files:
            return files
        raise CheckpointError(f"no *.safetensors file in {path}")
    raise FileNotFoundError(f"checkpoint not found: {path}")


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _listing(title: str, items: list[str], limit: int = 10) -> str:
    more = f" ... and {len(items) - limit} more" if len(items) > limit else ""
    return f"{title} ({len(items)}): {', '.join(items[:limit])}{more}"


def check_config_agrees(path: Path, spec: ModelSpec) -> None:
    """If `path` is a folder with a `config.json`, it must describe `spec`'s function."""
    config = path / "config.json" if path.is_dir() else None
    if config is None or not config.is_file():
        return
    from labkit.specs.hf_config import from_hf_config
    theirs = from_hf_config(config)
    diffs = [f"{f.name} {getattr(theirs, f.name)!r} != {getattr(spec, f.name)!r}"
             for f in dataclasses.fields(spec) if f.name not in _NOT_FUNCTION
             and getattr(theirs, f.name) != getattr(spec, f.name)]
    mine, other = family_config(spec), family_config(theirs)
    diffs += [f"{f.name} {getattr(other, f.name)!r} != {getattr(mine, f.name)!r}"
              for f in dataclasses.fields(mine) if f.name != "unsupported"
              and getattr(other, f.name) != getattr(mine, f.name)]
    if diffs:
        raise CheckpointError(f"checkpoint {config} describes another model than "
                              f"{spec.name!r} (config.json != model): " + "; ".join(diffs)
                              + f"; load it with model={str(path)!r}")


def load_safetensors(path_or_dir: str | Path, spec: ModelSpec,
                     dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The weights of a local checkpoint (one file, or a folder of shards), keyed by
    labkit's names and checked against `spec`; cast to `dtype` if given."""
    try:
        from safetensors.torch import load_file
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("loading checkpoints needs `pip install safetensors`") from err
    path = Path(path_or_dir)
    check_config_agrees(path, spec)
    tensors: dict[str, torch.Tensor] = {}
    for f in _files(path):
        try:
            loaded = load_file(str(f))
        except Exception as err:  # safetensors' own error types: not a checkpoint
            raise CheckpointError(f"checkpoint {f} is not a readable safetensors file "
                                  f"({_first_line(err)})") from None
        for name, t in loaded.items():
            if _IGNORED.search(name):
                continue
            if name in tensors:
                raise CheckpointError(f"tensor {name!r} appears in more than one file ({f})")
            tensors[name] = t
    tensors = to_labkit_names(tensors, spec)
    emb = tensors.get("model.embed_tokens.weight")
    if spec.tie_word_embeddings and "lm_head.weight" in tensors and emb is not None \
            and torch.equal(tensors["lm_head.weight"], emb):
        del tensors["lm_head.weight"]  # a tied checkpoint that stores the copy anyway
    expected = weight_shapes(spec)
    for j in range(spec.num_mtp_modules):  # MTP modules are optional, each all or nothing
        prefix = f"model.layers.{spec.num_layers + j}."
        if not any(n.startswith(prefix) for n in tensors):
            expected = {n: s for n, s in expected.items() if not n.startswith(prefix)}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = sorted(f"{n} {tuple(tensors[n].shape)} != {expected[n]}"
                   for n in set(expected) & set(tensors) if tuple(tensors[n].shape) != expected[n])
    if missing or unexpected or wrong:
        parts = [_listing(t, i) for t, i in (("missing", missing), ("unexpected", unexpected),
                                             ("shape mismatch", wrong)) if i]
        raise CheckpointError(f"checkpoint {path_or_dir} does not match model "
                              f"{spec.name!r}: " + "; ".join(parts))
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    return tensors
