"""Text prompts: the tokenizer that sits beside a Hugging Face model's config.

A model read from a folder (`Engine(model=folder)`) whose `tokenizer.json` is there too
(what a fast tokenizer's `save_pretrained` writes; the `tokenizers` library's format)
takes prompts as text: `Engine.submit_prompt("...")` encodes them, `Engine.tokenizer`
decodes what the compute plane generated. Encoding is the tokenizer's own, special
tokens included (a BOS its post-processor adds). No chat template is applied: a chat
prompt is text the caller has formatted.
"""

from __future__ import annotations

from pathlib import Path

from labkit.errors import ConfigError
from labkit.specs.models import ModelSpec


class Tokenizer:
    def __init__(self, path: Path) -> None:
        try:
            from tokenizers import Tokenizer as _Impl
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError(f"{path} needs `pip install tokenizers`") from err
        self.path = path
        self._impl = _Impl.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return list(self._impl.encode(text).ids)

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return self._impl.decode([int(t) for t in token_ids],
                                 skip_special_tokens=skip_special_tokens)


def load_tokenizer(spec: ModelSpec) -> Tokenizer | None:
    """The tokenizer beside the config the model was read from, if there is one."""
    if not spec.source.endswith("config.json"):
        return None
    path = Path(spec.source).parent / "tokenizer.json"
    return Tokenizer(path) if path.is_file() else None


def no_tokenizer(spec: ModelSpec) -> ConfigError:
    return ConfigError(f"model {spec.name!r} has no tokenizer.json beside its config.json: "
                       "prompts must be token ids")
