"""Hugging Face checkpoint names -> labkit's weight names (`weights.py`), per family.

Llama, Qwen3-MoE and DeepSeek checkpoints as `save_pretrained` writes them already use
labkit's names. Two families do not:

- Kimi-Linear: the MLP (dense or MoE) is `block_sparse_moe`, routed experts are
  `w1` (gate), `w3` (up), `w2` (down), and each KDA layer's `A_log` is stored
  `[1, 1, heads, 1]` (labkit: `[heads]`).
- gpt-oss: the router is `mlp.router` (with a bias); the experts are fused tensors,
  `gate_up_proj` `[E, H, 2I]` whose columns interleave gate and up (gate at even,
  up at odd positions), `down_proj` `[E, I, H]` — both stored `[in, out]` — and their
  biases `gate_up_proj_bias` `[E, 2I]`, `down_proj_bias` `[E, H]`. They are split into
  labkit's per-expert `[out, in]` matrices, which is what EP and TP slice.

Buffers that are not weights (`rotary_emb.inv_freq`) are dropped.
"""

from __future__ import annotations

import re

import torch

from labkit.specs.models import ModelSpec

Tensor = torch.Tensor

_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
_KIMI_EXPERT = re.compile(r"\.experts\.(\d+)\.w([123])\.")
_KIMI_W = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


def to_labkit_names(tensors: dict[str, Tensor], spec: ModelSpec) -> dict[str, Tensor]:
    """The same tensors under labkit's names (see the module docstring)."""
    out: dict[str, Tensor] = {}
    for name, t in tensors.items():
        if _IGNORED.search(name):
            continue
        if spec.family == "kimi_linear":
            name, t = _kimi(name, t)
        elif spec.family == "gpt_oss" and ".mlp." in name:
            out.update(_gpt_oss_mlp(name, t))
            continue
        out[name] = t
    return out


def _kimi(name: str, t: Tensor) -> tuple[str, Tensor]:
    name = name.replace(".block_sparse_moe.", ".mlp.")
    name = _KIMI_EXPERT.sub(lambda m: f".experts.{m.group(1)}.{_KIMI_W[m.group(2)]}.", name)
    if name.endswith("self_attn.A_log") and t.dim() == 4:
        t = t.reshape(-1)
    return name, t


def _gpt_oss_mlp(name: str, t: Tensor) -> dict[str, Tensor]:
    prefix, _, leaf = name.partition(".mlp.")
    p = prefix + ".mlp."
    if leaf.startswith("router."):
        return {p + "gate." + leaf[len("router."):]: t}
    experts = {
        "experts.gate_up_proj": lambda e: {"gate_proj.weight": t[e][:, 0::2].T,
                                           "up_proj.weight": t[e][:, 1::2].T},
        "experts.gate_up_proj_bias": lambda e: {"gate_proj.bias": t[e][0::2],
                                                "up_proj.bias": t[e][1::2]},
        "experts.down_proj": lambda e: {"down_proj.weight": t[e].T},
        "experts.down_proj_bias": lambda e: {"down_proj.bias": t[e]},
    }
    if leaf not in experts:
        return {name: t}  # not a gpt-oss tensor: the shape check names it
    return {f"{p}experts.{e}.{k}": v.contiguous()
            for e in range(t.shape[0]) for k, v in experts[leaf](e).items()}
