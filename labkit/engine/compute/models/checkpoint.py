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

Nothing is read whole unless asked: `CheckpointReader` reads the headers, and then any
tensor or piece of one (a TP slice, an expert) on demand, so each process of a
multi-GPU engine reads just what its GPU holds. `load_safetensors` reads everything.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from labkit.engine.compute.models.family import family_config
from labkit.engine.compute.models.hf_names import IGNORED, View, hf_views
from labkit.engine.compute.models.sharding import Part
from labkit.engine.compute.models.weights import weight_shapes
from labkit.errors import ConfigError
from labkit.specs.models import ModelSpec

# ModelSpec fields that are bookkeeping, not the function
_NOT_FUNCTION = {"name", "source", "constants", "max_model_len", "block_size", "weight_dtype",
                 "num_mtp_modules"}


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


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


@dataclass(slots=True)
class ReadCount:
    """What this process has read from checkpoints: bytes (as stored) and tensor names
    (labkit's). A process that builds one GPU's shard reads only that GPU's part."""

    bytes: int = 0
    names: set = dataclasses.field(default_factory=set)

    def reset(self) -> None:
        self.bytes = 0
        self.names.clear()


READS = ReadCount()  # this process's total (instrumentation: tests, benchmarks)


class CheckpointReader:
    """A local checkpoint opened without reading its tensors: only the files' headers
    are read here (names, shapes), renamed (`hf_names.hf_views`) and checked against
    `spec`; `read(name, part)` then reads one tensor, or one piece of it, from its file.

    `verify` also checks that a tied model's stored `lm_head.weight` equals its
    embedding (reading both): the driver does it once; a worker trusts it."""

    def __init__(self, path_or_dir: str | Path, spec: ModelSpec,
                 dtype: torch.dtype | None = None, verify: bool = True) -> None:
        try:
            from safetensors import safe_open
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError("loading checkpoints needs `pip install safetensors`") from err
        self._open, self.dtype = safe_open, dtype
        self.path = Path(path_or_dir)
        check_config_agrees(self.path, spec)
        self._file: dict[str, str] = {}  # stored key -> its file
        self._stored_dtype: dict[str, torch.dtype] = {}
        self.views: dict[str, View] = {}
        for f in _files(self.path):
            try:
                with safe_open(str(f), "pt") as handle:
                    stored = {k: handle.get_slice(k) for k in handle.keys()}
                    heads = {k: (tuple(s.get_shape()), s.get_dtype()) for k, s in stored.items()}
            except Exception as err:  # safetensors' own error types: not a checkpoint
                raise CheckpointError(f"checkpoint {f} is not a readable safetensors file "
                                      f"({_first_line(err)})") from None
            for key, (shape, dt) in heads.items():
                if IGNORED.search(key):
                    continue
                if key in self._file:
                    raise CheckpointError(f"tensor {key!r} appears in more than one file ({f})")
                self._file[key], self._stored_dtype[key] = str(f), _DTYPES.get(dt)
                self.views.update(hf_views(key, shape, spec))
        if spec.tie_word_embeddings and "lm_head.weight" in self.views \
                and "model.embed_tokens.weight" in self.views \
                and (not verify or torch.equal(self.read("lm_head.weight"),
                                               self.read("model.embed_tokens.weight"))):
            del self.views["lm_head.weight"]  # a tied checkpoint that stores the copy anyway
        self._check(spec)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: v.shape for n, v in self.views.items()}

    def read(self, name: str, part: Part | None = None) -> torch.Tensor:
        """Tensor `name` (labkit's name), or only `part` of it, cast to `dtype`."""
        view = self.views[name]
        if part is not None and part.zeros:
            return torch.zeros(view.shape, dtype=self.dtype or self._stored_dtype[view.key])
        with self._open(self._file[view.key], "pt") as handle:
            t = view.read(handle.get_slice(view.key), part)
        READS.bytes += t.numel() * t.element_size()
        READS.names.add(name)
        return t if self.dtype is None else t.to(self.dtype)

    def _check(self, spec: ModelSpec) -> None:
        expected = weight_shapes(spec)
        have = self.views
        for j in range(spec.num_mtp_modules):  # MTP modules are optional, each all or nothing
            prefix = f"model.layers.{spec.num_layers + j}."
            if not any(n.startswith(prefix) for n in have):
                expected = {n: s for n, s in expected.items() if not n.startswith(prefix)}
        missing = sorted(set(expected) - set(have))
        unexpected = sorted(set(have) - set(expected))
        wrong = sorted(f"{n} {have[n].shape} != {expected[n]}"
                       for n in set(expected) & set(have) if have[n].shape != expected[n])
        if missing or unexpected or wrong:
            parts = [_listing(t, i) for t, i in (("missing", missing),
                                                 ("unexpected", unexpected),
                                                 ("shape mismatch", wrong)) if i]
            raise CheckpointError(f"checkpoint {self.path} does not match model "
                                  f"{spec.name!r}: " + "; ".join(parts))


def load_safetensors(path_or_dir: str | Path, spec: ModelSpec,
                     dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The weights of a local checkpoint (one file, or a folder of shards), keyed by
    labkit's names and checked against `spec`; cast to `dtype` if given."""
    reader = CheckpointReader(path_or_dir, spec, dtype)
    return {name: reader.read(name) for name in reader.views}
