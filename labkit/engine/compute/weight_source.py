"""Where a rank's weights come from: whole tensors in memory, seeds, or a checkpoint.

A rank holds pieces of the model's tensors (its stage's layers, its TP slices, its
experts: rank_weights.py). It reads them from a *weight source*: `shapes` (every tensor
of the full model, by name) and `read(name, part)` (the tensor, or only a
`sharding.Part` of it). Three kinds:

- `DictSource`: the full weights already in memory (given, or read whole once for all
  the ranks of this process, as the threads executor does); a part is cut from them.
- `SeededSource`: labkit's seeded random weights, made one tensor at a time
  (`init_tensor` depends on the name alone, so they equal `init_weights`' bit for bit).
- `models.checkpoint.CheckpointReader`: a safetensors checkpoint, where a part is read
  from the file without the rest of the tensor: a worker process reads only its GPU's
  share of the checkpoint.
"""

from __future__ import annotations

import torch

from labkit.engine.compute.models.sharding import Part, apply_part
from labkit.engine.compute.models.weights import init_tensor, weight_shapes
from labkit.specs.models import ModelSpec


class DictSource:
    def __init__(self, full: dict[str, torch.Tensor]) -> None:
        self.full = full
        self.shapes = {n: tuple(t.shape) for n, t in full.items()}

    def read(self, name: str, part: Part | None = None) -> torch.Tensor:
        t = self.full[name]
        return t if part is None else apply_part(t, part)


class SeededSource:
    def __init__(self, spec: ModelSpec, seed: int, dtype: torch.dtype) -> None:
        self.seed, self.dtype = seed, dtype
        self.shapes = weight_shapes(spec)

    def read(self, name: str, part: Part | None = None) -> torch.Tensor:
        t = init_tensor(name, self.shapes[name], self.seed, self.dtype)
        return t if part is None else apply_part(t, part)


def as_source(weights):
    """A weight source as it is; a dict of full tensors wrapped as one."""
    return DictSource(weights) if isinstance(weights, dict) else weights
