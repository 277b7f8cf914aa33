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

Each labkit tensor is a `View` of one stored tensor: which one, and how to get from it
to labkit's layout (pick an expert, the even or odd columns, transpose, flatten). A view
reads any rows or columns of the labkit tensor (`View.read` with a `sharding.Part`) by
asking the file for only the stored elements they come from, so a process that holds
one TP slice or a few experts never reads the rest. Buffers that are not weights
(`rotary_emb.inv_freq`) are dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from labkit.engine.compute.models.sharding import Part
from labkit.specs.models import ModelSpec

Tensor = torch.Tensor

IGNORED = re.compile(r"rotary_emb\.inv_freq$")
_KIMI_EXPERT = re.compile(r"\.experts\.(\d+)\.w([123])\.")
_KIMI_W = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


@dataclass(frozen=True, slots=True)
class View:
    """Labkit tensor of `shape` = stored tensor `key` [at `expert`, the first index of a
    fused experts tensor], [its last dim's entries `parity`::2], [transposed (2-D)],
    [flattened: labkit's one dim is stored dim `flat_dim`, the others being 1]."""

    key: str
    shape: tuple[int, ...]
    expert: int | None = None
    parity: int | None = None
    transpose: bool = False
    flat_dim: int | None = None

    def read(self, stored, part: Part | None = None) -> Tensor:
        """`part` of this tensor, from `stored` (a safetensors slice: indexing it reads
        only the indexed elements). A whole-tensor or zeros part is the caller's."""
        ndim = len(stored.get_shape()) - (self.expert is not None)
        index = [slice(None)] * ndim
        last = ndim - 1
        if part is not None and part.dim is not None:
            d = self._stored_dim(part.dim)
            a, b = part.start, part.stop
            if self.parity is not None and d == last:  # entry i is stored at 2i + parity
                a, b = 2 * a, 2 * b
            index[d] = slice(a, b)
        t = stored[tuple(([self.expert] if self.expert is not None else []) + index)]
        if self.parity is not None:
            t = t[..., self.parity::2]
        if self.transpose:
            t = t.T
        if self.flat_dim is not None:
            t = t.reshape(-1)
        return t.contiguous()

    def _stored_dim(self, dim: int) -> int:
        if self.transpose:
            return 1 - dim
        return self.flat_dim if self.flat_dim is not None else dim


def hf_views(key: str, shape: tuple[int, ...], spec: ModelSpec) -> dict[str, View]:
    """The labkit tensors stored checkpoint tensor `key` of `shape` holds, by name
    (one for most; one per expert and matrix for gpt-oss's fused experts)."""
    if IGNORED.search(key):
        return {}
    if spec.family == "kimi_linear":
        return dict([_kimi(key, shape)])
    if spec.family == "gpt_oss" and ".mlp." in key:
        return _gpt_oss_mlp(key, shape)
    return {key: View(key, shape)}


def _kimi(key: str, shape: tuple[int, ...]) -> tuple[str, View]:
    name = key.replace(".block_sparse_moe.", ".mlp.")
    name = _KIMI_EXPERT.sub(lambda m: f".experts.{m.group(1)}.{_KIMI_W[m.group(2)]}.", name)
    if name.endswith("self_attn.A_log") and len(shape) == 4:
        return name, View(key, (shape[2],), flat_dim=2)
    return name, View(key, shape)


def _gpt_oss_mlp(key: str, shape: tuple[int, ...]) -> dict[str, View]:
    prefix, _, leaf = key.partition(".mlp.")
    p = prefix + ".mlp."
    if leaf.startswith("router."):
        return {p + "gate." + leaf[len("router."):]: View(key, shape)}
    experts = {  # labkit matrix -> (shape, parity, transpose) of expert e's stored slice
        "experts.gate_up_proj": lambda: {
            "gate_proj.weight": ((shape[2] // 2, shape[1]), 0, True),
            "up_proj.weight": ((shape[2] // 2, shape[1]), 1, True)},
        "experts.gate_up_proj_bias": lambda: {"gate_proj.bias": ((shape[1] // 2,), 0, False),
                                              "up_proj.bias": ((shape[1] // 2,), 1, False)},
        "experts.down_proj": lambda: {"down_proj.weight": ((shape[2], shape[1]), None, True)},
        "experts.down_proj_bias": lambda: {"down_proj.bias": ((shape[1],), None, False)},
    }
    if leaf not in experts:
        return {key: View(key, shape)}  # not a gpt-oss tensor: the shape check names it
    return {f"{p}experts.{e}.{k}": View(key, s, expert=e, parity=par, transpose=tr)
            for e in range(shape[0]) for k, (s, par, tr) in experts[leaf]().items()}
