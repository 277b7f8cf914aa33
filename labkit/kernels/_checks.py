"""Argument checks shared by the public kernel functions.

Every problem raises `KernelArgumentError` (a ValueError) whose message starts with the
function's name and names the argument, what was expected and what came. Shapes,
dtypes, devices and strides are checked on every call (host-side metadata, no GPU
work); *values* (table entries, lengths, slots) only for CPU tensors, where reading
them is free — on CUDA that would force a device sync on every layer of every step.
"""

from __future__ import annotations

from numbers import Real

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT32 = (torch.int32,)
INDEX_DTYPES = (torch.int32, torch.int64)

_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
          torch.int32: "int32", torch.int64: "int64"}


class KernelArgumentError(ValueError):
    """A kernel was called with a tensor of the wrong shape, dtype, device or layout."""


def _dtypes(ds) -> str:
    return " or ".join(_NAMES.get(d, str(d)) for d in ds)


class Checker:
    def __init__(self, fn: str):
        self.fn = fn
        self.device = None
        self.device_from = None

    def fail(self, msg: str):
        raise KernelArgumentError(f"{self.fn}: {msg}")

    def tensor(self, name: str, x, dims: str, dtypes, *, last_contiguous: bool = False):
        """x must be a tensor with len(dims.split(',')) dims of one of `dtypes`, on the
        same device as the tensors checked before it. `dims` reads like 'B,Hq,D'."""
        ndim = len(dims.split(","))
        if not isinstance(x, torch.Tensor):
            self.fail(f"{name} must be a torch.Tensor [{dims}], got {type(x).__name__}")
        if x.dim() != ndim:
            self.fail(f"{name} must be {ndim}-D [{dims}], got shape {tuple(x.shape)}")
        if x.dtype not in dtypes:
            self.fail(f"{name} must have dtype {_dtypes(dtypes)}, got {x.dtype}")
        if self.device is None:
            self.device, self.device_from = x.device, name
        elif x.device != self.device:
            self.fail(f"{name} is on {x.device} but {self.device_from} is on {self.device}; "
                      "all tensors must be on one device")
        if last_contiguous and x.shape[-1] > 1 and x.stride(-1) != 1:
            self.fail(f"{name} must be contiguous in its last dimension (a strided view over "
                      f"the other dims is fine), got strides {tuple(x.stride())}")
        return x

    def same_dtype(self, name: str, x, ref_name: str, ref):
        if x.dtype != ref.dtype:
            self.fail(f"{name} must have the same dtype as {ref_name} ({ref.dtype}), got {x.dtype}")

    def dim(self, name: str, x, axis: int, what: str, expected: int, why: str = ""):
        if x.shape[axis] != expected:
            why = f" ({why})" if why else ""
            self.fail(f"{name}.shape[{axis}] ({what}) must be {expected}{why}, "
                      f"got shape {tuple(x.shape)}")

    def scale(self, scale) -> float:
        if isinstance(scale, torch.Tensor) and scale.numel() == 1:
            scale = scale.item()
        if isinstance(scale, bool) or not isinstance(scale, Real):
            self.fail(f"scale must be a real number, got {type(scale).__name__}")
        scale = float(scale)
        if not (scale > 0 and scale != float("inf")):
            self.fail(f"scale must be a positive finite number, got {scale}")
        return scale

    def kv_cache_pair(self, k_cache, v_cache) -> None:
        """Paged K and V caches `[num_blocks, block_size, Hkv, D]` of one shape."""
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
            self.tensor(name, x, "num_blocks,block_size,Hkv,D", FLOAT_DTYPES,
                        last_contiguous=True)

    def same_shape(self, name: str, x, ref_name: str, ref) -> None:
        if tuple(x.shape) != tuple(ref.shape):
            self.fail(f"{name} must have {ref_name}'s shape {tuple(ref.shape)}, "
                      f"got {tuple(x.shape)}")

    def kv_lora_rank(self, rank, latent_dim: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 < rank <= latent_dim:
            self.fail(f"kv_lora_rank must be an int in [1, {latent_dim}] (the latent dim), "
                      f"got {rank!r}")

    @property
    def on_cpu(self) -> bool:
        return self.device is not None and self.device.type == "cpu"

    # ---- value checks (CPU tensors only) ----

    def lengths(self, name: str, lens: torch.Tensor, capacity: int, capacity_why: str):
        if not self.on_cpu or lens.numel() == 0:
            return
        lo, hi = int(lens.min()), int(lens.max())
        if lo < 0:
            self.fail(f"{name} must be >= 0, got {lo}")
        if hi > capacity:
            self.fail(f"{name} has {hi} > {capacity} ({capacity_why})")

    def window(self, window) -> int:
        """A sliding window in tokens; 0 = none (full causal attention)."""
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            self.fail(f"window must be an int >= 0 (0 = no sliding window), got {window!r}")
        return window

    def paged_lengths(self, lens_name: str, lens: torch.Tensor, table: torch.Tensor,
                      page: int, num_blocks: int, first: torch.Tensor | None = None):
        """Lengths fit in their block-table rows, and the entries they use name blocks
        (`first`: each row's first position read, when a sliding window skips some)."""
        self.lengths(lens_name, lens, table.shape[1] * page,
                     f"block_table holds {table.shape[1]} blocks of {page} tokens")
        self.table_entries("block_table", table, lens, page, num_blocks, first)

    def table_entries(self, name: str, table: torch.Tensor, lens: torch.Tensor, page: int,
                      num_blocks: int, first: torch.Tensor | None = None):
        """Entries a request uses (from block first // page, default 0, up to
        ceil(len / page)) must name existing blocks; the rest of the row may hold
        anything (blocks that left a sliding window are -1)."""
        if not self.on_cpu or table.numel() == 0:
            return
        needed = (lens.to(torch.int64) + page - 1) // page
        cols = torch.arange(table.shape[1])[None, :]
        used = cols < needed[:, None]
        if first is not None:
            used &= cols >= (first.to(torch.int64) // page)[:, None]
        bad = used & ((table < 0) | (table >= num_blocks))
        if bool(bad.any()):
            r, c = (int(i) for i in bad.nonzero()[0])
            self.fail(f"{name}[{r}, {c}] = {int(table[r, c])} is used (within the request's "
                      f"length) but is not a block id in [0, {num_blocks})")
