"""One GPU's paged KV cache, addressed by the KV manager's physical block ids.

The KV manager of a DP rank hands out block ids; each of the replica's GPUs keeps, for
every attention layer of its stage, tensors indexed by those same ids:

- GQA: `k`, `v` `[num_blocks, block_size, kv_heads_here, head_dim]`;
- MLA: `latent` `[num_blocks, block_size, kv_lora_rank + rope_dim]` (one per token);
- DSA: also `index_k` `[num_blocks, block_size, index_head_dim]` (the indexer's keys).

Under DCP a block's tokens are spread over the `dcp` GPUs of a DCP group: position p
belongs to member `(p // I) % dcp` (I = `dcp_kv_cache_interleave_size`), and each
member's block holds only its `block_size / dcp` tokens, in position order. So a
member's *local index* of an owned position — `block * local_block_size + offset` —
counts the owned positions before it, which is what the attention kernels' `seq_lens`
mean on a shard: the first `local_len(n)` local entries are the owned positions < n.
"""

from __future__ import annotations

import numpy as np
import torch

from labkit.errors import ConfigError
from labkit.kernels import reshape_and_cache, reshape_and_cache_latent


class PagedKV:
    def __init__(self, shapes: dict[int, dict[str, tuple[int, ...]]], num_blocks: int,
                 block_size: int, dcp: int = 1, dcp_index: int = 0, interleave: int = 1,
                 dtype: torch.dtype = torch.float32, device="cpu") -> None:
        if block_size % (interleave * dcp):
            raise ConfigError(
                f"block_size={block_size} must be a multiple of dcp ({dcp}) x "
                f"dcp_kv_cache_interleave_size ({interleave}) to shard KV blocks")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dcp, self.dcp_index, self.interleave = dcp, dcp_index, interleave
        self.local_block_size = block_size // dcp
        self.layers = {
            layer: {name: torch.zeros((num_blocks, self.local_block_size) + shape,
                                      dtype=dtype, device=device)
                    for name, shape in named.items()}
            for layer, named in shapes.items()
        }

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for named in self.layers.values()
                   for t in named.values())

    # --------------------------------------------------------- addressing
    def owned(self, positions: np.ndarray) -> np.ndarray:
        return (positions // self.interleave) % self.dcp == self.dcp_index

    def _local_offset(self, positions: np.ndarray) -> np.ndarray:
        o, cycle = positions % self.block_size, self.interleave * self.dcp
        return (o // cycle) * self.interleave + o % self.interleave

    def slots(self, positions: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        """Physical slots (block * local_block_size + offset) of owned `positions`,
        whose blocks (the request's table at `positions // block_size`) are `blocks`."""
        return blocks.astype(np.int64) * self.local_block_size + self._local_offset(positions)

    def local_len(self, lengths: np.ndarray) -> np.ndarray:
        """Owned positions among 0..n-1, for each n in `lengths`."""
        cycle = self.interleave * self.dcp
        full, rest = np.divmod(np.asarray(lengths, dtype=np.int64), cycle)
        return full * self.interleave + np.clip(rest - self.dcp_index * self.interleave, 0,
                                                self.interleave)

    def local_index(self, positions: np.ndarray) -> np.ndarray:
        """Index of each owned position among the request's owned positions."""
        return positions // self.block_size * self.local_block_size + \
            self._local_offset(positions)

    # ------------------------------------------------------------ reading
    def gather(self, layer: int, name: str, table: np.ndarray, n_local: int) -> torch.Tensor:
        """The first `n_local` owned entries of a request (block table `table`)."""
        return self.gather_at(layer, name, table, np.arange(n_local))

    def gather_at(self, layer: int, name: str, table: np.ndarray,
                  idx: np.ndarray) -> torch.Tensor:
        """A request's owned entries at local indices `idx` (block table `table`)."""
        cache = self.layers[layer][name]
        blocks = torch.as_tensor(table[idx // self.local_block_size], dtype=torch.long,
                                 device=cache.device)
        offsets = torch.as_tensor(idx % self.local_block_size, dtype=torch.long,
                                  device=cache.device)
        return cache[blocks, offsets]

    # ------------------------------------------------------------ writing
    def write(self, layer: int, name: str, values: torch.Tensor, slots: np.ndarray) -> None:
        """Store one entry per token (`[T, dim]`: a latent, an index key) at `slots`."""
        cache = self.layers[layer][name]
        reshape_and_cache_latent(values.to(cache.dtype), cache, self._slots(slots, cache))

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: np.ndarray) -> None:
        """Store GQA keys and values `[T, kv_heads, head_dim]` at `slots`."""
        kc, vc = self.layers[layer]["k"], self.layers[layer]["v"]
        reshape_and_cache(k.to(kc.dtype), v.to(vc.dtype), kc, vc, self._slots(slots, kc))

    @staticmethod
    def _slots(slots: np.ndarray, cache: torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(slots, dtype=torch.long, device=cache.device)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block src's content into block dst, in every layer."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long)
        for named in self.layers.values():
            for t in named.values():
                t[dst.to(t.device)] = t[src.to(t.device)]

    def copy_from(self, other: PagedKV, src_blocks: np.ndarray, dst_blocks: np.ndarray) -> None:
        """Fetch blocks from another replica's matching GPU (a session moved ranks)."""
        src = torch.as_tensor(src_blocks, dtype=torch.long)
        dst = torch.as_tensor(dst_blocks, dtype=torch.long)
        for layer, named in self.layers.items():
            for name, t in named.items():
                t[dst.to(t.device)] = other.layers[layer][name][src.to(t.device)].to(t.device)
