"""Loading a local Hugging Face safetensors checkpoint into labkit's weight names.

Hugging Face Llama checkpoints already use labkit's names (see `weights`), so the map
is the identity, minus buffers that are not weights (`rotary_emb.inv_freq`). The
tensors are checked against `weight_shapes(spec)` before anything is returned: a
missing, unexpected or wrongly shaped tensor raises `CheckpointError` naming them all.
Only the Llama family is verified against real checkpoints; note that labkit's plain
RoPE omits Llama-3's frequency scaling, so logits of a real Llama-3.1 checkpoint differ
slightly from Hugging Face's. Needs the `safetensors` package.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from labkit.engine.compute.models.weights import weight_shapes
from labkit.errors import ConfigError
from labkit.specs.models import ModelSpec

_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


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


def load_safetensors(path_or_dir: str | Path, spec: ModelSpec,
                     dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The weights of a local checkpoint (one file, or a folder of shards), keyed by
    labkit's names and checked against `spec`; cast to `dtype` if given."""
    try:
        from safetensors.torch import load_file
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("loading checkpoints needs `pip install safetensors`") from err
    tensors: dict[str, torch.Tensor] = {}
    for f in _files(Path(path_or_dir)):
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
    emb = tensors.get("model.embed_tokens.weight")
    if spec.tie_word_embeddings and "lm_head.weight" in tensors and emb is not None \
            and torch.equal(tensors["lm_head.weight"], emb):
        del tensors["lm_head.weight"]  # a tied checkpoint that stores the copy anyway
    expected = weight_shapes(spec)
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
