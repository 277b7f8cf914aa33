"""A GPU rank: what it keeps between steps, and what it knows during one.

`Rank` is the persistent part — its place in the mesh, its slice of the weights, its
paged KV, the recurrent state of linear-attention layers — and the handles on the
groups it talks to. `RankStep` is one step seen from that rank: which of the replica's
new tokens it computes (its PCP rows), where each new token's KV goes in its shard
(per layer: a sliding-window layer writes into its own table's pages, see
`step_batch`), and the collectives that move per-row tensors between PCP and DCP
peers. Model code (`rank_model`, `attention`, `moe_parallel`) only ever reads these two
objects.
"""

from __future__ import annotations

import numpy as np
import torch

from labkit.engine.compute.group import Group
from labkit.engine.compute.linear_state import LinearSnapshots, LinearStates
from labkit.engine.compute.mesh import Mesh, RankPlace
from labkit.engine.compute.paged_kv import PagedKV
from labkit.engine.compute.step_batch import StepBatch
from labkit.engine.layouts import dcp_shard_tokens


class Rank:
    def __init__(self, place: RankPlace, mesh: Mesh, weights: dict[int | str, dict],
                 kv: PagedKV, groups: dict[str, Group]) -> None:
        self.place, self.mesh, self.spec = place, mesh, mesh.spec
        self.weights = weights  # layer -> its tensors; "model" -> embeddings, norm, head
        self.kv = kv
        self.linear = LinearStates(kv.block_size)
        linear = [i for i in weights if isinstance(i, int) and self.spec.is_linear_layer(i)]
        self.snapshots = LinearSnapshots(self.linear, linear)  # of this GPU's linear layers
        self.tp, self.pcp, self.dcp = groups["tp"], groups["pcp"], groups["dcp"]
        self.ep, self.pp = groups["ep"], groups["pp"]


class RankStep:
    def __init__(self, rank: Rank, batch: StepBatch) -> None:
        self.rank, self.batch, self.kv = rank, batch, rank.kv
        place, mesh = rank.place, rank.mesh
        self.rows = batch.rows(place.pcp_index)
        self.positions = batch.positions[self.rows]
        self.slots_all = self._slots(batch.block_table)
        self._window_slots = None  # the sliding-window layers' slots, when first asked
        self._pcp_members = [mesh.places[g].pcp_index for g in place.pcp_group]
        self._dcp_members = [mesh.places[g].pcp_index for g in place.dcp_group]
        if batch.pcp > 1:
            order = batch.gathered_order(self._pcp_members)
            self._to_token_order = torch.as_tensor(np.argsort(order, kind="stable"))
        self.dcp_rows = [batch.rows(c) for c in self._dcp_members]

    def _slots(self, table: np.ndarray) -> np.ndarray:
        """Where each of the replica's new tokens goes in my shard (-1: not mine)."""
        batch, kv = self.batch, self.kv
        pos = batch.positions
        blocks = table[batch.entry_of, pos // batch.block_size] if batch.num_tokens else \
            np.zeros(0, np.int64)
        if (blocks < 0).any():  # a negative slot would silently skip the write
            raise RuntimeError("a new token's block is not held (-1 in its table; a window "
                               "table's freed block?): the KV manager must hold the blocks "
                               "a step writes")
        return np.where(kv.owned(pos), kv.slots(pos, blocks), -1)

    @property
    def device(self):
        return self.batch.device

    def slots(self, layer: int) -> np.ndarray:
        """Slots of the new tokens' KV in `layer`'s paged cache (its table's pages)."""
        if not self.rank.spec.is_sliding_layer(layer):
            return self.slots_all
        if self._window_slots is None:
            self._window_slots = self._slots(self.batch.table(sliding=True))
        return self._window_slots

    # ----------------------------------------------------------- PCP helpers
    def all_tokens(self, per_row: torch.Tensor) -> torch.Tensor:
        """A per-row tensor of my rows -> the same for all the replica's new tokens, in
        token order (PCP all-gathers it from the other PCP ranks)."""
        if self.batch.pcp == 1:
            return per_row
        gathered = self.rank.pcp.all_gather(per_row)
        return gathered[self._to_token_order.to(gathered.device)]

    def my_rows(self, per_token: torch.Tensor) -> torch.Tensor:
        if self.batch.pcp == 1:
            return per_token
        return per_token[torch.as_tensor(self.rows, device=per_token.device)]

    # ----------------------------------------------------------- DCP helpers
    def dcp_gather_rows(self, per_row: torch.Tensor) -> torch.Tensor:
        """All-gather per-row tensors of the DCP group (rows of `dcp_rows`, in member
        order)."""
        if len(self.rank.place.dcp_group) == 1:
            return per_row
        return self.rank.dcp.all_gather(per_row)

    def dcp_return_rows(self, per_row: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        """Send each member its slice (`sizes`, in member order) of a tensor over the
        gathered rows; returns the slices every member computed for *my* rows."""
        if len(self.rank.place.dcp_group) == 1:
            return [per_row]
        return self.rank.dcp.all_to_all(list(torch.split(per_row, sizes)))

    def context(self, layer: int, name: str, entries: list[int]) -> list[torch.Tensor]:
        """Each entry's cached entries at positions 0..context+new-1, in position order;
        under DCP the shards are all-gathered and interleaved."""
        kv, batch = self.kv, self.batch
        ends = [batch.entries[i].context + batch.entries[i].num_new for i in entries]
        locals_ = [kv.gather(layer, name, batch.entries[i].table, int(kv.local_len([n])[0]))
                   for i, n in zip(entries, ends)]
        if kv.dcp == 1:
            return locals_
        gathered = self.rank.dcp.all_gather(torch.cat(locals_) if locals_ else
                                            kv.layers[layer][name].new_zeros(
                                                (0,) + kv.layers[layer][name].shape[2:]))
        out, offset = [], 0
        per_member = []
        for j in range(kv.dcp):
            lens = [dcp_shard_tokens(n, kv.dcp, kv.interleave, j) for n in ends]
            total = sum(lens)
            per_member.append(torch.split(gathered[offset:offset + total], lens))
            offset += total
        for e, n in enumerate(ends):
            full = gathered.new_empty((n,) + gathered.shape[1:])
            owner = (np.arange(n) // kv.interleave) % kv.dcp
            for j in range(kv.dcp):
                full[torch.as_tensor(np.nonzero(owner == j)[0])] = per_member[j][e]
            out.append(full)
        return out

