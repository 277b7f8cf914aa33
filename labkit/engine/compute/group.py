"""Ranks and collectives: SPMD code over a `Group`, N virtual ranks in one process.

Model code in the compute plane is written the way it runs on a real cluster: every
rank executes the same function on its own shard and talks to the others only through
collectives of a `Group` — all_gather, all_reduce, reduce_scatter, all_to_all,
broadcast, send / recv. `VirtualCluster` runs N ranks as N threads of one process,
which is the default: nothing to launch, and every rank's tensors stay inspectable
from a notebook. One rank thread runs at a time (`_Baton`), until it waits in a
collective: a small model's step is thousands of tiny torch calls that hold the GIL
for most of their time, and eight threads on two cores would hand it to each other
around every one of them. A torch.distributed implementation (gloo on CPU, NCCL on
GPU) only needs the same methods.

Reductions add contributions in rank order, so results are bit-for-bit reproducible.
If one rank raises, the others are released (their pending collective fails) and the
original error is re-raised by `VirtualCluster.run`.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch

TIMEOUT_S = 600.0


class Group:
    """The collective interface rank-local code may use (see module docstring)."""

    rank: int  # position of this rank in the group
    size: int
    ranks: tuple[int, ...]  # global ranks of the members, in group order

    def all_gather(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        raise NotImplementedError

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def reduce_scatter(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        total = self.all_reduce(t)
        return torch.chunk(total, self.size, dim=dim)[self.rank].clone()

    def all_to_all(self, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        raise NotImplementedError

    def _check_chunks(self, chunks: list) -> None:
        if len(chunks) != self.size:
            raise ValueError(f"all_to_all needs {self.size} chunks, got {len(chunks)}")

    def broadcast(self, t: torch.Tensor | None, src: int = 0) -> torch.Tensor:
        raise NotImplementedError

    def send(self, t: torch.Tensor, dst: int) -> None:
        raise NotImplementedError

    def recv(self, src: int) -> torch.Tensor:
        raise NotImplementedError


def sum_in_order(parts: list[torch.Tensor]) -> torch.Tensor:
    """The members' contributions added in member order: the same bits on every run,
    whichever executor moved them."""
    total = parts[0].clone()
    for p in parts[1:]:
        total += p
    return total


class _Rendezvous:
    """Where the members of one group meet: each deposits a value, all read all."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.slots: list = [None] * size
        self.barrier = threading.Barrier(size, timeout=TIMEOUT_S)
        self.mailboxes = {(s, d): queue.Queue() for s in range(size) for d in range(size)}

    def exchange(self, rank: int, value) -> list:
        self.slots[rank] = value
        self.barrier.wait()
        values = list(self.slots)
        self.barrier.wait()  # everyone has read before the slots are reused
        return values


class _Baton:
    """Which rank threads may run: at most `running` at once, each until it waits for
    the others.

    Threads of one process share the GIL, and torch hands it back around each call it
    makes; with more ranks runnable than there are cores they pass it to each other
    thousands of times a step (futex calls and context switches: eight ranks on two
    cores spent more system time than work). Holding a turn, a rank runs until it meets
    a collective, gives its turn up while it waits there, and takes one back after.
    The results cannot change: collectives fix what each rank sees, not when it runs.
    The one rule it adds: a rank waits for another only through this module's
    collectives (one blocked elsewhere keeps its turn, which the other may need)."""

    def __init__(self, running: int) -> None:
        self._turns = threading.Semaphore(running)
        self._mine = threading.local()

    @contextmanager
    def held(self):
        self._turns.acquire()
        self._mine.held = True
        try:
            yield
        finally:
            self._mine.held = False
            self._turns.release()

    @contextmanager
    def passed(self):
        """Let another rank run while this thread waits (if it holds a turn: a lone
        rank run in the caller's thread does not)."""
        if not getattr(self._mine, "held", False):
            yield
            return
        self._mine.held = False
        self._turns.release()
        try:
            yield
        finally:
            self._turns.acquire()
            self._mine.held = True


class VirtualGroup(Group):
    def __init__(self, rendezvous: _Rendezvous, rank: int, ranks: tuple[int, ...],
                 baton: _Baton) -> None:
        self._rv = rendezvous
        self._baton = baton
        self.rank = rank
        self.size = rendezvous.size
        self.ranks = ranks
        self.comm_s = 0.0  # seconds this member spent inside collectives (waits included)

    def _exchange(self, value) -> list:
        start = time.perf_counter()
        try:
            with self._baton.passed():
                return self._rv.exchange(self.rank, value)
        finally:
            self.comm_s += time.perf_counter() - start

    def all_gather(self, t, dim=0):
        return torch.cat(self._exchange(t), dim=dim)

    def all_reduce(self, t):
        return sum_in_order(self._exchange(t))

    def all_to_all(self, chunks):
        self._check_chunks(chunks)
        sent = self._exchange(chunks)
        return [sent[src][self.rank] for src in range(self.size)]

    def broadcast(self, t, src=0):
        return self._exchange(t)[src].clone()

    def send(self, t, dst):
        self._rv.mailboxes[(self.rank, dst)].put(t.clone())

    def recv(self, src):
        start = time.perf_counter()
        try:
            with self._baton.passed():
                return self._rv.mailboxes[(src, self.rank)].get(timeout=TIMEOUT_S)
        finally:
            self.comm_s += time.perf_counter() - start


class VirtualCluster:
    """N ranks as threads; groups over any subset of them. `running` of them run at
    once (`_Baton`; measured on two cores, a tiny DeepSeek-V3 replay: with one at a
    time, 8 ranks took 60 s where free threads took 83, 4 ranks 31 s against 52 s and
    2 ranks 33 s against 23 s but less CPU time: 33 CPU s against 36)."""

    def __init__(self, world_size: int, running: int = 1) -> None:
        self.world_size = world_size
        self._pool = ThreadPoolExecutor(max_workers=world_size,
                                        thread_name_prefix="labkit-rank")
        self._rendezvous: dict[tuple[int, ...], _Rendezvous] = {}
        self._baton = _Baton(running)

    def group(self, ranks, me: int) -> VirtualGroup:
        """Rank `me`'s handle on the group of global `ranks` (same object for all)."""
        ranks = tuple(ranks)
        rv = self._rendezvous.setdefault(ranks, _Rendezvous(len(ranks)))
        return VirtualGroup(rv, ranks.index(me), ranks, self._baton)

    def run(self, fn, args_per_rank: list, ranks: list[int] | None = None) -> list:
        """fn(rank, *args) on every rank (or on `ranks`, one args tuple each) at once;
        their results, in that order."""
        ranks = list(range(len(args_per_rank))) if ranks is None else list(ranks)
        if len(ranks) == 1:  # nobody to talk to: no thread hop
            return [fn(ranks[0], *args_per_rank[0])]
        futures = [self._pool.submit(self._guarded, fn, rank, *args)
                   for rank, args in zip(ranks, args_per_rank)]
        results, first_error = [], None
        for f in futures:
            try:
                results.append(f.result())
            except threading.BrokenBarrierError:
                results.append(None)
            except BaseException as err:  # noqa: BLE001 - re-raised below
                first_error = first_error or err
                results.append(None)
        if first_error is not None:
            self._reset()
            raise first_error
        return results

    def _guarded(self, fn, rank, *args):
        try:
            with self._baton.held():
                return fn(rank, *args)
        except BaseException:
            for rv in self._rendezvous.values():  # release ranks stuck in a collective
                rv.barrier.abort()
            raise

    def _reset(self) -> None:
        self._rendezvous = {k: _Rendezvous(len(k)) for k in self._rendezvous}

    def close(self) -> None:
        self._pool.shutdown(wait=False)
