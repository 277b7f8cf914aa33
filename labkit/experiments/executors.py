"""Where a sweep's points run: local worker processes, or Ray tasks on a cluster.

A sweep (`sweep.py`) and the planner (`plan.py`) both hand an executor a list of
independent tasks — one Python function applied to many argument tuples — and take
the results back *as they finish*, in whatever order. The executor decides where the
calls run:

- ``local``: a pool of `jobs` worker processes on this machine (spawned clean; each
  dies with the sweep and ignores Ctrl-C, see `workers.py`).
- ``ray``: one Ray task per call (``num_cpus=1`` each), on the cluster at
  ``ray.init(address=...)`` or, without an address, on a local Ray cluster of `jobs`
  CPUs started for this sweep and shut down after it. The function and its
  arguments travel by pickle, so they must be importable on the workers (labkit's
  own functions are); file paths in the arguments must be readable there too.

An argument every task shares — the same object at the same place in every tuple, a
planner's trace say — travels once, not once per task: a local worker gets it when it
starts (the pool's initializer), a Ray cluster holds it once in its object store
(``ray.put``; the tasks take a reference, zero-copy where they can). A 400-session
agentic trace pickles to ~350 MB in ~0.8 s and unpickles in as long: per task, that
was a third of a planner point's time.

Either way `run_tasks` yields ``(index, result, error)`` per task: `error` is None or
the exception the call raised (or that killed its worker). Ctrl-C (KeyboardInterrupt),
or closing the generator early, stops what is still running — worker processes and
their children killed, Ray tasks force-cancelled. `import ray` happens only for the Ray executor: it
is the optional extra ``labkit[ray]``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed

from labkit.errors import ConfigError
from labkit.experiments.workers import stop_workers, worker_init

EXECUTORS = ("local", "ray")


def check_executor(executor: str, ray_address: str | None = None) -> None:
    """A clear one-line refusal before anything runs."""
    if executor not in EXECUTORS:
        raise ConfigError(f"--executor {executor!r} is not known; allowed: "
                          + ", ".join(EXECUTORS))
    if ray_address is not None and executor != "ray":
        raise ConfigError("--ray-address needs --executor ray")
    if executor == "ray":
        try:
            import ray  # noqa: F401
        except ImportError:
            raise ConfigError("--executor ray needs Ray: pip install 'labkit[ray]'") from None


def run_tasks(fn: Callable, args: Sequence[tuple], executor: str = "local", jobs: int = 1,
              ray_address: str | None = None) -> Iterator[tuple[int, object, BaseException | None]]:
    """``fn(*args[i])`` for every i, yielded as ``(i, result, error)`` when each ends."""
    check_executor(executor, ray_address)
    if not args:
        return
    runner = _run_ray if executor == "ray" else _run_local
    yield from runner(fn, args, jobs, ray_address)


def shared_places(args: Sequence[tuple]) -> list[int]:
    """The places in the argument tuples where every task passes the same object (by
    identity; numbers, strings and None aside: they cost nothing to send)."""
    if len(args) < 2:
        return []
    first = args[0]
    return [j for j, x in enumerate(first)
            if not isinstance(x, (int, float, str, bytes, type(None)))
            and all(len(a) == len(first) and a[j] is x for a in args)]


def _without(args: tuple, places: list[int]) -> tuple:
    return tuple(x for j, x in enumerate(args) if j not in places)


def _with(args: tuple, places: list[int], shared: tuple) -> tuple:
    """`args` with `shared` put back at `places` (ascending)."""
    out = list(args)
    for j, x in zip(places, shared):
        out.insert(j, x)
    return tuple(out)


# ------------------------------------------------------------------------- local
_SHARED: tuple = ()  # in a local worker: the arguments every task shares


def _local_worker_init(parent_pid: int, shared: tuple) -> None:
    global _SHARED
    worker_init(parent_pid)
    _SHARED = shared


def _call_with_shared(fn, places: list[int], args: tuple):
    return fn(*_with(args, places, _SHARED))


def _run_local(fn, args, jobs, _address):
    places = shared_places(args)
    shared = tuple(args[0][j] for j in places)
    # spawn: workers start clean (no inherited threads or kernel state), on every OS;
    # each gets the shared arguments once, as it starts
    pool = ProcessPoolExecutor(max_workers=min(jobs, len(args)),
                               mp_context=multiprocessing.get_context("spawn"),
                               initializer=_local_worker_init, initargs=(os.getpid(), shared))
    try:
        with _main_module_hidden():  # workers start on submit
            futures = {pool.submit(_call_with_shared, fn, places, _without(a, places)): i
                       for i, a in enumerate(args)}
        for future in as_completed(futures):
            try:
                yield futures[future], future.result(), None
            except Exception as err:  # the call raised, or its worker process died
                yield futures[future], None, err
    except (KeyboardInterrupt, GeneratorExit):  # Ctrl-C, or the caller stopped listening
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C waits
        try:
            stop_workers(pool)
            pool.shutdown(wait=True, cancel_futures=True)
        finally:
            signal.signal(signal.SIGINT, previous)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


@contextlib.contextmanager
def _main_module_hidden():
    """A spawned worker re-imports the caller's ``__main__`` script unless it is
    hidden; workers need nothing from it, and re-running it would start the sweep
    again in a script without an ``if __name__ == "__main__"`` guard (or fail, for
    ``python -``)."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__")
             if main is not None and k in main.__dict__}
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            if "__spec__" in saved:
                main.__spec__ = None
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)


# --------------------------------------------------------------------------- ray
RAY_START_ATTEMPTS = 2


def _start_ray(ray, address: str | None, jobs: int) -> None:
    """Join the cluster at `address`, or start a local one of `jobs` CPUs."""
    # no usage report from a sweep (and this machine may have no network); on a busy
    # machine Ray's agents can take longer than the 30 s the raylet waits by default
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_agent_register_timeout_ms", "180000")
    if address is not None:
        ray.init(address=address, log_to_driver=False)
        return
    # a private local cluster, as wide as --jobs. Ray's memory monitor kills tasks when
    # the *machine* is nearly full, whoever fills it: on a shared workstation that
    # kills a sweep's points.
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        try:
            ray.init(num_cpus=jobs, include_dashboard=False, log_to_driver=False)
            return
        except Exception:  # noqa: BLE001 - Ray raises a bare Exception on a slow start
            # the node did not register within Ray's fixed 30 s (a busy machine: its
            # agents are still importing); a second start finds them warm
            ray.shutdown()
            if attempt == RAY_START_ATTEMPTS:
                raise


def _run_ray(fn, args, jobs, address):
    import ray

    started = not ray.is_initialized()
    if started:
        _start_ray(ray, address, jobs)
    remote = ray.remote(num_cpus=1, max_retries=0)(fn)
    refs: dict = {}
    try:
        places = shared_places(args)
        # once in the object store; a task's argument that is a reference arrives as
        # the object it names
        shared = tuple(ray.put(args[0][j]) for j in places)
        refs = {remote.remote(*_with(_without(a, places), places, shared)): i
                for i, a in enumerate(args)}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                try:
                    yield refs[ref], ray.get(ref), None
                except Exception as err:  # RayTaskError wraps what the call raised
                    yield refs[ref], None, getattr(err, "cause", None) or err
    except (KeyboardInterrupt, GeneratorExit):
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            for ref in refs:
                with contextlib.suppress(Exception):
                    ray.cancel(ref, force=True)
        finally:
            signal.signal(signal.SIGINT, previous)
        raise
    finally:
        if started:
            ray.shutdown()
