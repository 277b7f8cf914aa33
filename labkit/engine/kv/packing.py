"""How a KV block's bytes sit in GPU memory: one buffer per layer, or packed.

vLLM allocates one tensor per attention layer (`[num_blocks, block_size, heads, dim]`,
K and V apart; MLA: the latent, plus DeepSeek-V3.2's indexer keys): block *b* is the
*b*-th slot of every one of those buffers. Copying a block anywhere — to host memory
for offload, to a decode pool for P/D — then takes one copy descriptor per buffer:
layers x tensors of them, each only `block_size x bytes per token per layer` long.
For DeepSeek-V3 (61 layers, one latent each) with 64-token blocks that is 61 copies of
41 KiB per block.

A **packed** layout puts all of a block's layers in one contiguous region (the layer
inside the block, not the block inside the layer): one descriptor per block and GPU.
Per-descriptor costs (a DMA or RDMA work request, a `cudaMemcpyAsync`) then stop
dominating small transfers, which is also what lets a deployment keep **small
blocks** — finer prefix reuse, less memory wasted in the partly filled last block of
every call (*internal fragmentation*, which the engine reports) — without paying for
it in transfers.

`BlockLayout` gives both layouts' figures for a placement; transfers (offload loads,
P/D hand-offs) add `descriptors x DMA_DESCRIPTOR_S` per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.errors import unknown_choice

KV_LAYOUTS = ("per_layer", "packed")
# Issuing one copy descriptor: an RDMA work request posted and completed, or one entry
# of a batched DMA — ~4 million a second per GPU. (A cudaMemcpyAsync per region costs
# ~10x more; engines that copy per layer batch them for that reason.)
DMA_DESCRIPTOR_S = 0.25e-6


@dataclass(frozen=True, slots=True)
class BlockLayout:
    kind: str  # "per_layer" | "packed"
    block_bytes: float  # one block's KV on one GPU, every layer it holds
    descriptors_per_block: int  # contiguous regions one block spans on one GPU

    @property
    def bytes_per_descriptor(self) -> float:
        return self.block_bytes / self.descriptors_per_block

    def copy_overhead_s(self, num_blocks: int) -> float:
        """Issuing the copies of num_blocks blocks on one GPU (their bytes aside)."""
        return num_blocks * self.descriptors_per_block * DMA_DESCRIPTOR_S


def tensors_per_layer(model) -> int:
    """KV tensors of one attention layer: K and V, or MLA's latent (+ indexer keys)."""
    if model.is_mla:
        return 1 + (1 if model.has_indexer else 0)
    return 2


def block_layout(placement, block_size: int, kind: str = "per_layer") -> BlockLayout:
    if kind not in KV_LAYOUTS:
        raise unknown_choice("kv_layout", kind, KV_LAYOUTS)
    block_bytes = block_size * placement.kv_bytes_per_token_per_gpu()
    buffers = placement._kv_layers_per_gpu() * tensors_per_layer(placement.model)
    return BlockLayout(kind, block_bytes, 1 if kind == "packed" else max(1, buffers))
