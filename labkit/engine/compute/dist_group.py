"""The `Group` collectives over torch.distributed: one process per GPU rank.

`VirtualGroup` (group.py) meets its peers in shared memory; `DistGroup` meets them
through a torch.distributed process group — gloo between CPU processes, NCCL between
GPUs — so the same rank-local model code runs whether ranks are threads or processes.

Two things the model code relies on that torch.distributed does not give directly:

- **ragged shapes**: an all-gather of PCP rows or DCP shards, an EP all-to-all of the
  tokens routed to each member, carry different row counts per member. Each call first
  exchanges the row counts (one small all-gather), then moves tensors padded to the
  longest (all-gather) or exactly sized (point-to-point, for all-to-all and send/recv).
- **bit-exact reductions**: `all_reduce` gathers every member's contribution and adds
  them in member order, as `VirtualGroup` does, so threads and processes give the same
  bits (a ring all-reduce adds in an order that depends on the member).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from labkit.engine.compute.group import Group, sum_in_order

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.uint8, torch.bool, torch.int8)
_HEADER = 10  # dtype code, ndim, up to 8 dims


class DistGroup(Group):
    def __init__(self, process_group, ranks: tuple[int, ...], me: int) -> None:
        self.pg = process_group
        self.ranks = tuple(ranks)  # global (process) ranks, in group order
        self.rank = self.ranks.index(me)
        self.size = len(self.ranks)
        self.comm_s = 0.0  # seconds inside collectives, waits included (as VirtualGroup)

    @contextmanager
    def _timed(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.comm_s += time.perf_counter() - start

    # ------------------------------------------------------------ collectives
    def all_gather(self, t, dim=0):
        with self._timed():
            return torch.cat(self._gather_ragged(t, dim), dim=dim)

    def all_reduce(self, t):
        with self._timed():
            parts = self._gather_equal(t)
        return sum_in_order(parts)

    def all_to_all(self, chunks):
        self._check_chunks(chunks)
        with self._timed():
            return self._all_to_all(chunks)

    def broadcast(self, t, src=0):
        with self._timed():
            if self.rank == src:
                header = _header(t)
                out = t.contiguous().clone()
            else:
                header = torch.zeros(_HEADER, dtype=torch.int64, device=self._device(t))
            dist.broadcast(header, self.ranks[src], group=self.pg)
            if self.rank != src:
                out = _empty(header)
            if out.numel():
                dist.broadcast(out, self.ranks[src], group=self.pg)
            return out

    def send(self, t, dst):
        t = t.contiguous()
        dist.send(_header(t), self.ranks[dst], group=self.pg)
        if t.numel():
            dist.send(t, self.ranks[dst], group=self.pg)

    def recv(self, src):
        with self._timed():
            header = torch.zeros(_HEADER, dtype=torch.int64, device=self._device(None))
            dist.recv(header, self.ranks[src], group=self.pg)
            out = _empty(header)
            if out.numel():
                dist.recv(out, self.ranks[src], group=self.pg)
            return out

    # -------------------------------------------------------------- internals
    def _device(self, t):
        if t is not None:
            return t.device
        return torch.device("cuda") if dist.get_backend(self.pg) == "nccl" else \
            torch.device("cpu")

    def _gather_equal(self, t: torch.Tensor) -> list[torch.Tensor]:
        t = t.contiguous()
        if t.dtype == torch.bool:
            return [p.bool() for p in self._gather_equal(t.to(torch.uint8))]
        outs = [torch.empty_like(t) for _ in range(self.size)]
        if t.numel():
            dist.all_gather(outs, t, group=self.pg)
        return outs

    def _counts(self, n: int, device) -> list[int]:
        mine = torch.tensor([n], dtype=torch.int64, device=device)
        return [int(c) for c in self._gather_equal(mine)]

    def _gather_ragged(self, t: torch.Tensor, dim: int) -> list[torch.Tensor]:
        counts = self._counts(t.shape[dim], t.device)
        longest = max(counts)
        if longest == t.shape[dim]:
            padded = t
        else:
            pad = list(t.shape)
            pad[dim] = longest - t.shape[dim]
            padded = torch.cat([t, t.new_zeros(pad)], dim=dim)
        return [p.narrow(dim, 0, n) for p, n in zip(self._gather_equal(padded), counts)]

    def _all_to_all(self, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        mine = chunks[self.rank]
        sent = torch.tensor([c.shape[0] for c in chunks], dtype=torch.int64, device=mine.device)
        counts = self._gather_equal(sent)  # counts[src][dst]: rows src sends dst
        received: list[torch.Tensor | None] = [None] * self.size
        ops = []
        for j in range(self.size):
            if j == self.rank:
                received[j] = mine.clone()
                continue
            if chunks[j].numel():
                ops.append(dist.P2POp(dist.isend, chunks[j].contiguous(), self.ranks[j],
                                      self.pg))
            rows = int(counts[j][self.rank])
            received[j] = mine.new_empty((rows,) + tuple(mine.shape[1:]))
            if received[j].numel():
                ops.append(dist.P2POp(dist.irecv, received[j], self.ranks[j], self.pg))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return received


class SoloGroup(Group):
    """A group of one: every collective is the identity (no process group needed)."""

    def __init__(self, me: int) -> None:
        self.rank, self.size, self.ranks = 0, 1, (me,)
        self.comm_s = 0.0

    def all_gather(self, t, dim=0):
        return t

    def all_reduce(self, t):
        return t.clone()

    def all_to_all(self, chunks):
        return [chunks[0]]

    def broadcast(self, t, src=0):
        return t.clone()

    def send(self, t, dst):
        raise RuntimeError("send within a group of one")

    def recv(self, src):
        raise RuntimeError("recv within a group of one")


def _header(t: torch.Tensor) -> torch.Tensor:
    if t.dim() > _HEADER - 2:
        raise ValueError(f"DistGroup moves tensors of at most {_HEADER - 2} dims")
    values = [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    return torch.tensor(values + [0] * (_HEADER - len(values)), dtype=torch.int64,
                        device=t.device)


def _empty(header: torch.Tensor) -> torch.Tensor:
    h = header.tolist()
    return torch.empty(h[2:2 + h[1]], dtype=_DTYPES[h[0]], device=header.device)
