"""`DistGroup` (torch.distributed, gloo) returns what `VirtualGroup` (threads) returns.

The same collective calls — ragged all-gathers (a member with no rows), all-to-all with
empty chunks, ints and bools, a broadcast from a non-zero member, send/recv of an empty
tensor — run on two threads of a `VirtualCluster` and on two processes; every result
must be equal in value, shape and dtype.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from labkit.engine.compute.dist_group import DistGroup
from labkit.engine.compute.group import VirtualCluster


def collectives(group, rank: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)[: [3, 0][rank]] + 100 * rank
    out = {"all_gather": group.all_gather(x),
           "all_gather_dim1": group.all_gather(torch.full((2, rank + 1), float(rank)), dim=1),
           "all_reduce": group.all_reduce(torch.randn(5, 3, generator=g)),
           "reduce_scatter": group.reduce_scatter(torch.arange(8.0) * (rank + 1)),
           "all_to_all": group.all_to_all([torch.full((k + rank, 2), 10.0 * rank + k)
                                           for k in range(2)]),
           "all_to_all_int": group.all_to_all([torch.tensor([rank, k]) for k in range(2)]),
           "broadcast": group.broadcast(torch.tensor([[1.5, 2.5]]) if rank == 1 else None,
                                        src=1),
           "bool": group.all_gather(torch.tensor([True, rank == 1]))}
    if rank == 0:
        group.send(torch.ones(2, 3) * 7, 1)
        group.send(torch.zeros(0, 3), 1)
    else:
        out["recv"] = [group.recv(0), group.recv(0)]
    return out


def _process(rank: int, port: int, folder: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    group = DistGroup(dist.new_group([0, 1]), (0, 1), rank)
    torch.save(collectives(group, rank), f"{folder}/{rank}.pt")
    dist.destroy_process_group()


def flat(value, key=""):
    if isinstance(value, dict):
        return {k: v for name, item in value.items() for k, v in flat(item, name).items()}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in flat(item, f"{key}.{i}").items()}
    return {key: value}


def test_processes_return_what_threads_return(tmp_path):
    cluster = VirtualCluster(2)
    threads = cluster.run(lambda r: collectives(cluster.group((0, 1), r), r), [(), ()])
    cluster.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp.spawn(_process, args=(port, str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        a, b = flat(threads[rank]), flat(torch.load(tmp_path / f"{rank}.pt"))
        assert a.keys() == b.keys() and len(a) >= 9
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), (rank, k)
    assert flat(threads[0])["all_gather"].shape == (3, 4)  # member 1 had no rows
    assert flat(threads[1])["recv.1"].shape == (0, 3)
