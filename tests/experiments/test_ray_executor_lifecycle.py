"""The Ray executor's cluster handling, on a stand-in `ray` module (no cluster: fast).

What it must do, as `executors.py` says: start a local cluster of `jobs` CPUs when none
is running and shut it down after the tasks (also after an error or an early close),
retry a start that timed out once, use a cluster that is already running (or one at
an address) and leave it running, and hand each task's error back with its index.
The real cluster is `test_sweep_ray.py`'s (slow)."""

from __future__ import annotations

import sys
import types

import pytest

from labkit.experiments.executors import run_tasks


class FakeRay(types.ModuleType):
    """The few calls of Ray's API the executor makes; tasks run as they are submitted."""

    def __init__(self, running: bool = False, failed_starts: int = 0) -> None:
        super().__init__("ray")
        self.running, self.failed_starts = running, failed_starts
        self.calls: list = []

    def is_initialized(self) -> bool:
        return self.running

    def init(self, **kwargs) -> None:
        self.calls.append(("init", kwargs))
        if self.failed_starts:
            self.failed_starts -= 1
            raise Exception("the node did not register in time")  # as Ray raises it
        self.running = True

    def shutdown(self) -> None:
        self.calls.append(("shutdown",))
        self.running = False

    def remote(self, **options):
        assert options == dict(num_cpus=1, max_retries=0)
        assert self.running, "a task submitted with no cluster"

        def wrap(fn):
            def submit(*args):
                try:
                    return ("ok", fn(*args))
                except Exception as err:  # noqa: BLE001 - what Ray hands back on get
                    return ("error", err)
            return types.SimpleNamespace(remote=submit)
        return wrap

    def wait(self, pending, num_returns: int):
        return pending[:num_returns], pending[num_returns:]

    def get(self, ref):
        kind, value = ref
        if kind == "error":
            raise value
        return value

    def cancel(self, ref, force: bool) -> None:
        self.calls.append(("cancel", force))


def _square(x: int) -> int:
    if x == 3:
        raise ValueError("x=3 is impossible")
    return x * x


@pytest.fixture
def fake_ray(monkeypatch):
    def install(**kwargs) -> FakeRay:
        ray = FakeRay(**kwargs)
        monkeypatch.setitem(sys.modules, "ray", ray)
        return ray
    return install


def test_a_cluster_it_starts_is_as_wide_as_jobs_and_shut_down_after(fake_ray):
    ray = fake_ray()
    out = {i: (result, error) for i, result, error in
           run_tasks(_square, [(1,), (3,), (4,)], executor="ray", jobs=2)}
    assert {i: r for i, (r, e) in out.items() if e is None} == {0: 1, 2: 16}
    assert isinstance(out[1][1], ValueError) and "x=3" in str(out[1][1])
    kinds = [c[0] for c in ray.calls]
    assert kinds == ["init", "shutdown"] and not ray.running
    assert ray.calls[0][1]["num_cpus"] == 2


def test_a_slow_start_is_tried_once_more(fake_ray):
    ray = fake_ray(failed_starts=1)
    assert [r for _, r, _ in run_tasks(_square, [(2,)], executor="ray", jobs=1)] == [4]
    assert [c[0] for c in ray.calls] == ["init", "shutdown", "init", "shutdown"]


def test_a_start_that_keeps_failing_raises(fake_ray):
    ray = fake_ray(failed_starts=2)
    with pytest.raises(Exception, match="did not register"):
        list(run_tasks(_square, [(2,)], executor="ray", jobs=1))
    assert not ray.running


def test_a_running_cluster_is_used_and_left_running(fake_ray):
    ray = fake_ray(running=True)
    assert [r for _, r, _ in run_tasks(_square, [(5,)], executor="ray", jobs=4)] == [25]
    assert ray.calls == [] and ray.running


def test_an_address_is_joined(fake_ray):
    ray = fake_ray()
    list(run_tasks(_square, [(1,)], executor="ray", ray_address="ray://head:10001"))
    assert ray.calls[0] == ("init", dict(address="ray://head:10001", log_to_driver=False))
    assert not ray.running  # (it connected for the sweep: disconnected after)


def test_closing_early_cancels_what_runs_and_shuts_down(fake_ray):
    ray = fake_ray()
    tasks = run_tasks(_square, [(1,), (2,), (4,)], executor="ray", jobs=2)
    next(tasks)
    tasks.close()
    kinds = [c[0] for c in ray.calls]
    assert kinds.count("cancel") == 3 and kinds[-1] == "shutdown" and not ray.running
