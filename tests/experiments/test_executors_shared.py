"""An argument every task shares travels once per local worker, not once per task.

A planner hands every point the same trace (a 400-session agentic trace pickles to
~350 MB); the local executor gives it to each worker as the worker starts. Counted
here by pickling: the shared object is pickled once per worker process, the tasks'
own arguments once per task, and every task still sees it (and its own arguments, in
their places)."""

from __future__ import annotations

import pytest

from labkit.experiments.executors import run_tasks, shared_places

PICKLED: list[str] = []  # (in this process) the labels of Payloads pickled


class Payload:
    def __init__(self, label: str, size: int) -> None:
        self.label, self.items = label, list(range(size))

    def __reduce__(self):
        PICKLED.append(self.label)
        return (Payload, (self.label, len(self.items)))


def _task(before: int, shared: Payload, own: Payload, after: str) -> tuple:
    return before, shared.label, len(shared.items), own.label, after


def test_shared_places_are_the_same_object_in_every_task():
    big, other = Payload("big", 3), Payload("other", 3)
    assert shared_places([(1, big, "x"), (2, big, "x")]) == [1]  # "x": a string, sent anyway
    assert shared_places([(1, big), (2, other)]) == []  # equal-looking is not the same
    assert shared_places([(1, big)]) == []  # one task: nothing to share
    assert shared_places([(1, [0]), (2, [0])]) == []  # two lists, however alike


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_shared_argument_is_pickled_once_per_worker(jobs):
    PICKLED.clear()
    shared = Payload("shared", 1000)
    tasks = [(i, shared, Payload(f"own{i}", 1), f"after{i}") for i in range(5)]
    results = {i: (row, err) for i, row, err in run_tasks(_task, tasks, "local", jobs)}
    assert {i: err for i, (_, err) in results.items()} == dict.fromkeys(range(5))
    assert [results[i][0] for i in range(5)] == \
        [(i, "shared", 1000, f"own{i}", f"after{i}") for i in range(5)]
    assert 1 <= PICKLED.count("shared") <= jobs  # (was: once per task, 5)
    assert sorted(x for x in PICKLED if x != "shared") == [f"own{i}" for i in range(5)]
