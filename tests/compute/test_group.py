"""Collectives of the in-process virtual cluster against their definitions."""

import threading

import pytest
import torch

from labkit.engine.compute.group import VirtualCluster


@pytest.fixture(scope="module")
def cluster():
    c = VirtualCluster(4)
    yield c
    c.close()


def test_collectives(cluster):
    def body(rank):
        g = cluster.group(range(4), rank)
        x = torch.arange(6, dtype=torch.float64).reshape(2, 3) + 10 * rank
        gathered = g.all_gather(x, dim=0)
        reduced = g.all_reduce(x)
        scattered = g.reduce_scatter(torch.ones(8, dtype=torch.float64) * (rank + 1))
        received = g.all_to_all([torch.tensor([rank * 10 + dst]) for dst in range(4)])
        root = g.broadcast(torch.tensor([rank]) if rank == 2 else None, src=2)
        return gathered, reduced, scattered, torch.cat(received), root

    results = cluster.run(body, [()] * 4)
    base = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    expected_gather = torch.cat([base + 10 * r for r in range(4)])
    for rank, (gathered, reduced, scattered, received, root) in enumerate(results):
        assert torch.equal(gathered, expected_gather)
        assert torch.equal(reduced, 4 * base + 60)
        assert torch.equal(scattered, torch.full((2,), 10.0, dtype=torch.float64))
        assert received.tolist() == [src * 10 + rank for src in range(4)]
        assert root.tolist() == [2]


def test_subgroups_and_point_to_point(cluster):
    def body(rank):
        pair = cluster.group([0, 1] if rank < 2 else [2, 3], rank)
        total = pair.all_reduce(torch.tensor([float(rank)]))
        if pair.rank == 0:
            pair.send(torch.tensor([rank * 100]), dst=1)
            return total, None
        return total, pair.recv(src=0)

    out = cluster.run(body, [()] * 4)
    assert [t.item() for t, _ in out] == [1.0, 1.0, 5.0, 5.0]
    assert out[1][1].item() == 0 and out[3][1].item() == 200


def test_reductions_are_in_rank_order(cluster):
    values = [1e16, 1.0, -1e16, 1.0]  # float64 sums depend on the order

    def body(rank):
        return cluster.group(range(4), rank).all_reduce(
            torch.tensor([values[rank]], dtype=torch.float64)).item()

    sums = {tuple(cluster.run(body, [()] * 4)) for _ in range(5)}
    expected = ((values[0] + values[1]) + values[2]) + values[3]
    assert sums == {(expected,) * 4}


def test_an_error_on_one_rank_does_not_hang_the_others(cluster):
    def body(rank):
        if rank == 3:
            raise ValueError("rank 3 failed")
        return cluster.group(range(4), rank).all_reduce(torch.ones(1))

    threads = threading.active_count()  # (other tests of this process may hold some)
    with pytest.raises(ValueError, match="rank 3 failed"):
        cluster.run(body, [()] * 4)
    # the cluster still works afterwards
    assert cluster.run(lambda r: cluster.group(range(4), r).all_reduce(torch.ones(1)).item(),
                       [()] * 4) == [4.0] * 4
    assert threading.active_count() <= threads + 4  # no thread left waiting per failure


@pytest.mark.parametrize("running", [1, 2])
def test_ranks_take_turns_and_pass_them_on_in_collectives(running):
    """Between collectives at most `running` ranks run (the baton): never more ranks
    inside their own code at once, yet every rank gets through a collective, a receive
    that waits for a later send, and a second collective."""
    cluster = VirtualCluster(4, running=running)
    inside, most, lock = [0], [0], threading.Lock()

    def busy(n=200):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        for _ in range(n):  # long enough for the OS to switch threads if it may
            torch.ones(4).sum()
        with lock:
            inside[0] -= 1

    def body(rank):
        g = cluster.group(range(4), rank)
        busy()
        total = g.all_reduce(torch.tensor([float(rank)]))
        busy()
        if rank == 0:  # waits for rank 3, which sends only after its own work
            got = g.recv(src=3)
        elif rank == 3:
            busy()
            g.send(torch.tensor([7.0]), dst=0)
            got = None
        else:
            got = None
        busy()
        return total.item(), got, g.all_gather(torch.tensor([rank])).tolist()

    out = cluster.run(body, [()] * 4)
    cluster.close()
    assert 1 <= most[0] <= running
    assert [t for t, _, _ in out] == [6.0] * 4 and out[0][1].item() == 7.0
    assert all(gathered == [0, 1, 2, 3] for _, _, gathered in out)
