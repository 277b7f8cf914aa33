"""How each weight splits across tensor-parallel ranks (a helper; the runner may slice
its own way). Rank r of N takes the r-th of N equal chunks along the split dim:

- by heads (dim 0): GQA q_proj (and its bias) and sinks; MLA q_b_proj / q_proj and
  kv_b_proj; KDA q/k/v_proj, q/k/v_conv1d, f_b_proj, g_b_proj, dt_bias, A_log, b_proj.
- GQA k_proj / v_proj (and biases): by KV heads when N divides them, else each KV head
  is replicated on the N / Hkv ranks whose query heads read it.
- by input columns (dim 1): every o_proj (partial sums: all-reduce after).
- MLPs, routed and shared experts: gate/up (and their biases) by rows (dim 0), down by
  columns (dim 1).
- biases after a partial sum (o_proj, down_proj): whole on rank 0, zeros on the others,
  so the all-reduce adds them once.
- replicated: embeddings, LM head, norms, router and its bias, MLA q_a_proj /
  kv_a_proj_with_mqa (the latent is per token, not per head: TP replicates it), the DSA
  indexer, KDA f_a_proj / g_a_proj / o_norm, MTP eh_proj.

`tp_part` says which piece (a `Part`) from the name and shape alone, so a piece can be
read from a checkpoint without the rest (`checkpoint.CheckpointReader`); `tp_shard`
cuts the pieces out of whole tensors.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch

from labkit.specs.models import ModelSpec

_ROWS = re.compile(
    r"self_attn\.(q_proj|q_b_proj|kv_b_proj|[qkv]_conv1d|f_b_proj|g_b_proj|b_proj)\.weight$"
    r"|self_attn\.q_proj\.bias$|self_attn\.(dt_bias|A_log|sinks)$"
    r"|(gate_proj|up_proj)\.(weight|bias)$")
_COLS = re.compile(r"(o_proj|down_proj)\.weight$")
_ONCE = re.compile(r"(o_proj|down_proj)\.bias$")
_KV = re.compile(r"self_attn\.[kv]_proj\.(weight|bias)$")


class Part(NamedTuple):
    """A rank's piece of one tensor: the entries [start, stop) along `dim` (`dim` None:
    the whole tensor), or, with `zeros`, zeros of the whole tensor's shape."""

    dim: int | None = None
    start: int = 0
    stop: int = 0
    zeros: bool = False


WHOLE = Part()


def _piece(shape: tuple[int, ...], dim: int, parts: int, index: int, name: str) -> Part:
    if shape[dim] % parts:
        raise ValueError(f"cannot split {name} {tuple(shape)} into {parts} along dim {dim}")
    n = shape[dim] // parts
    return Part(dim, index * n, (index + 1) * n)


def tp_part(spec: ModelSpec, name: str, shape: tuple[int, ...], rank: int,
            size: int) -> Part:
    """Which piece of tensor `name` (of the full `shape`) TP rank `rank` of `size` holds."""
    gqa_kv = _KV.search(name) and not spec.is_mla and not _is_linear(spec, name)
    if gqa_kv:
        kv = spec.num_kv_heads
        if kv % size == 0:
            return _piece(shape, 0, size, rank, name)
        if size % kv == 0:
            return _piece(shape, 0, kv, rank // (size // kv), name)
        raise ValueError(f"{kv} KV heads fit neither side of TP {size}")
    if _ROWS.search(name) or _KV.search(name):
        return _piece(shape, 0, size, rank, name)
    if _COLS.search(name):
        return _piece(shape, 1, size, rank, name)
    if _ONCE.search(name):
        return WHOLE if rank == 0 else Part(zeros=True)
    return WHOLE


def apply_part(t: torch.Tensor, part: Part) -> torch.Tensor:
    """`part` of the whole tensor `t`."""
    if part.zeros:
        return torch.zeros_like(t)
    if part.dim is None:
        return t
    return t.narrow(part.dim, part.start, part.stop - part.start).contiguous()


def tp_shard(spec: ModelSpec, weights: dict[str, torch.Tensor], rank: int,
             size: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s slice of every tensor for tensor parallelism of degree `size`."""
    return {name: apply_part(t, tp_part(spec, name, tuple(t.shape), rank, size))
            for name, t in weights.items()}


def _is_linear(spec: ModelSpec, name: str) -> bool:
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return bool(m) and spec.is_linear_layer(int(m.group(1)))
