"""Models from Hugging Face configs: a `config.json` becomes a `ModelSpec`.

`from_hf_config(source)` takes a `config.json`, a folder holding one, or the parsed
dict, and reads every constant labkit needs: the shapes the simulation plans with
(layers, heads, MLA and indexer dims, sliding-window and linear-attention layers,
experts, MTP modules) and the constants the compute plane computes with (`FamilyConfig`:
RoPE and its scaling, norm epsilon, router, biases, sinks). One reader serves both:
`--model PATH` and `Engine(model=PATH)` go through `get_model`, the checkpoint loader
checks a folder's config against the model it loads into.

Keys a config omits take the default of transformers' config class for that
`model_type` (`DEFAULTS`, checked against transformers itself in `tests/specs`); the
reader does not import transformers, whose import pulls in torch, which the control
plane must not load. Multimodal wrappers (Kimi-K2.5, Qwen3.5) are read through their
`text_config`.

Two kinds of refusal:
- a config whose *shape* labkit cannot represent (an unknown `model_type`, dense layers
  that are not a leading run, ...) is a `ConfigError` naming the key, here;
- a key that changes the *function* but not the shapes (a RoPE type labkit does not
  compute, a partial rotary factor, an activation other than SiLU, ...) is recorded in
  `FamilyConfig.unsupported`: the simulation runs the model, the compute plane refuses
  it naming the key (`engine/compute/models/family.py`).

The per-`model_type` readers live in `hf_readers.py`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labkit.errors import ConfigError
from labkit.specs.family import RopeSpec
from labkit.specs.models import ModelSpec

# transformers' config-class defaults (5.x) of the keys the readers use, per model_type
def _rope(theta: float, **more) -> dict:
    return {"rope_type": "default", "rope_theta": theta, **more}


_COMMON = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
           "attention_bias": False, "rope_parameters": _rope(10000.0)}
_DEEPSEEK = dict(_COMMON, max_position_embeddings=4096, q_lora_rank=1536, n_group=8,
                 topk_group=4, routed_scaling_factor=2.5, first_k_dense_replace=3,
                 num_nextn_predict_layers=1, n_shared_experts=1, norm_topk_prob=True,
                 rope_interleave=True, moe_layer_freq=1, scoring_func="sigmoid")
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(_COMMON, max_position_embeddings=2048, mlp_bias=False),
    "mistral": dict(_COMMON, max_position_embeddings=131072, mlp_bias=False,
                    sliding_window=4096),
    "qwen3_moe": dict(_COMMON, max_position_embeddings=32768, norm_topk_prob=False,
                      decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False),
    "deepseek_v3": _DEEPSEEK,
    "kimi_k2": _DEEPSEEK,
    "deepseek_v32": dict(_DEEPSEEK, max_position_embeddings=163840, index_topk=2048),
    "glm_moe_dsa": dict(_DEEPSEEK, rms_norm_eps=1e-5, max_position_embeddings=202752,
                        q_lora_rank=2048, n_group=1, topk_group=1, index_topk=2048),
    "kimi_linear": dict(_COMMON, rms_norm_eps=1e-5, max_position_embeddings=1048576,
                        q_lora_rank=None, n_group=1, topk_group=1, routed_scaling_factor=2.446,
                        norm_topk_prob=True, n_shared_experts=1, linear_conv_kernel_dim=4),
    "gpt_oss": dict(_COMMON, rms_norm_eps=1e-5, max_position_embeddings=131072,
                    attention_bias=True, swiglu_limit=7.0, swiglu_alpha=1.702,
                    sliding_window=128,
                    rope_parameters=dict(rope_type="yarn", factor=32.0, beta_fast=32.0,
                                         beta_slow=1.0, truncate=False,
                                         original_max_position_embeddings=4096,
                                         rope_theta=150000.0)),
    "minimax_m2": dict(_COMMON, max_position_embeddings=196608,
                       rope_parameters=_rope(5000000.0)),
    "qwen3_5_moe_text": dict(_COMMON, max_position_embeddings=32768,
                             linear_conv_kernel_dim=4,
                             rope_parameters=_rope(10000.0, partial_rotary_factor=0.25)),
    "deepseek_v4": dict(_COMMON, max_position_embeddings=1048576, q_lora_rank=1024,
                        routed_scaling_factor=1.5, num_nextn_predict_layers=1,
                        n_shared_experts=1, index_topk=512, sliding_window=128,
                        rope_parameters=_rope(10000.0, partial_rotary_factor=0.125)),
}
_ROPE_KINDS = ("default", "linear", "yarn", "llama3")


@dataclass(slots=True)
class HFConfig:
    """A parsed config.json: its keys with transformers' defaults behind them, where it
    came from, and what the reader found it cannot compute."""

    raw: dict
    where: str
    unsupported: list[str] = field(default_factory=list)

    @property
    def model_type(self) -> str:
        return self.raw.get("model_type", "")

    def __call__(self, *keys: str) -> Any:
        """The first of `keys` the config sets (attribute aliases), else the default."""
        for key in keys:
            if key in self.raw:
                return self.raw[key]
        defaults = DEFAULTS.get(self.model_type, _COMMON)
        for key in keys:
            if key in defaults:
                return defaults[key]
        raise ConfigError(f"{self.where}: config.json has no {keys[0]!r} (and "
                          f"{self.model_type!r} has no default for it)")

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self(key)
        except ConfigError:
            return default

    def _shown(self, key: str) -> str:
        value = self.get(key)
        return f"{key} = {value!r}" + ("" if key in self.raw else " (the default)")

    def refuse(self, key: str, why: str) -> None:
        """`key` changes the function in a way labkit does not compute."""
        self.unsupported.append(f"{self._shown(key)} ({why})")

    def error(self, key: str, why: str) -> ConfigError:
        return ConfigError(f"{self.where}: {self._shown(key)}: {why}")


def load_config(source) -> tuple[dict, str]:
    """`(config dict, where it came from)` from a path (file or folder) or a dict."""
    if isinstance(source, dict):
        return source, "config"
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"no Hugging Face config at {source} (expected a config.json "
                          "or a folder holding one)")
    try:
        return json.loads(path.read_text()), str(path.resolve())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON (line {err.lineno}: {err.msg})") from None


def is_hf_path(model) -> bool:
    """Does `model` name a config.json or a folder holding one (not a preset name)?"""
    if not isinstance(model, (str, Path)):
        return False
    path = Path(model)
    return path.is_file() or (path / "config.json").is_file()


def from_hf_config(source, name: str | None = None) -> ModelSpec:
    """The ModelSpec of a Hugging Face config (see the module docstring)."""
    from labkit.specs.hf_readers import READERS

    raw, where = load_config(source)
    if "num_hidden_layers" not in raw and isinstance(raw.get("text_config"), dict):
        raw = dict(raw["text_config"])  # a multimodal wrapper: its language model
    cfg = HFConfig(raw, where)
    reader = READERS.get(cfg.model_type)
    if reader is None:
        raise ConfigError(f"{where}: model_type {cfg.model_type!r} is not one labkit reads; "
                          f"it reads {', '.join(sorted(READERS))}")
    if cfg("hidden_act") != "silu":
        cfg.refuse("hidden_act", "labkit's MLPs are SwiGLU with silu")
    fields = reader(cfg)
    if name is None:
        name = Path(where).parent.name if where != "config" else cfg.model_type
    return ModelSpec(name=name, source=where, **fields)


# ----------------------------------------------------------------- common parts
def rope_spec(cfg: HFConfig, max_len: int) -> RopeSpec:
    """The RoPE of `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling`
    (older configs); an unsupported type or a partial rotary factor is refused."""
    raw = cfg.raw
    params = raw.get("rope_parameters") or raw.get("rope_scaling")
    if params is None and "rope_theta" not in raw:
        params = cfg("rope_parameters")  # the config class's default RoPE
    params = dict(params or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", cfg.raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        cfg.unsupported.append(f"partial_rotary_factor = {partial} (labkit rotates whole "
                               "heads)")
    if kind not in _ROPE_KINDS:
        cfg.unsupported.append(f"rope_type = {kind!r} (labkit computes "
                               f"{', '.join(_ROPE_KINDS)})")
        return RopeSpec(theta)
    original = int(params.get("original_max_position_embeddings") or max_len)
    factor = params.get("factor")
    if kind == "yarn" and factor is None:  # (as transformers: the context ratio)
        factor = max_len / original
    def num(key: str, default: float) -> float:
        return float(params.get(key) or default)  # (as transformers: 0 / None -> default)

    return RopeSpec(
        theta, kind, factor=float(factor or 1.0), original_max_position_embeddings=original,
        beta_fast=num("beta_fast", 32), beta_slow=num("beta_slow", 1),
        mscale=num("mscale", 0), mscale_all_dim=num("mscale_all_dim", 0),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
        low_freq_factor=num("low_freq_factor", 1.0), high_freq_factor=num("high_freq_factor", 4.0))


def weight_dtype(cfg: HFConfig) -> str:
    """The dtype the simulation prices the linear layers in: fp8 for fp8 and mxfp4
    checkpoints (labkit has no fp4 kernels), fp16 for fp16 ones, else bf16 (a float32
    checkpoint is a test or training artefact; the compute plane's own `dtype` knob
    says what it computes in)."""
    quant = (cfg.raw.get("quantization_config") or {}).get("quant_method")
    if quant in ("fp8", "mxfp4"):
        return "fp8"
    return "fp16" if (cfg.raw.get("dtype") or cfg.raw.get("torch_dtype")) == "float16" \
        else "bf16"


def leading_dense(cfg: HFConfig, types: list[str], dense: str,
                  key: str = "mlp_layer_types") -> int:
    """How many leading layers are dense, given per-layer MLP types; dense layers that
    are not a leading run cannot be represented (`first_k_dense`): an error naming `key`."""
    k = 0
    while k < len(types) and types[k] == dense:
        k += 1
    if dense in types[k:]:
        raise cfg.error(key, "dense layers after the first MoE layer; labkit models a "
                        "leading run of dense layers only")
    return k
