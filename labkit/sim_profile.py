"""Where a simulated replay spends its CPU time, by engine component.

A profile of the simulator has to be read with care. cProfile charges every call its
own bookkeeping, which inflates the parts made of many small numpy calls two to three
times; a sampling profiler needs a tool from outside Python. This clock is cheaper
and plainer: it wraps a fixed list of the engine's methods — the block pool's, the KV
manager's, planning and playing fast-forwarded runs, single steps, commits, the cost
model — and charges each the process time spent in it *minus* the time spent in the
wrapped methods it calls (its exclusive time). So the components' times add up to the
whole replay; what no wrapped method claims stays with `Engine.replay` itself (event
dispatch, collecting the result). A wrapper costs about a microsecond a call, a few
per cent of a replay. One thread only: it is meant for the sim plane, whose replay runs
on the calling thread (the compute plane's rank threads would mix their calls).

    with component_clock() as clock:
        engine.replay(trace, concurrency=64, duration_s=600)
    clock.frame()  # component, group, calls, cpu_s, share

`labkit bench sim --breakdown` prints it for the simulator's speed benchmark.

Times on a shared machine vary by a quarter between identical runs, which hides the few
per cent a change to the engine's Python usually makes. What the interpreter *does* does
not vary: `call_counter` counts the calls a block makes — of Python functions, by
function, and of built-in ones (numpy's and Python's functions written in C, by name;
calling a ufunc or a compiled numba loop is not such a call and is not counted) — the
same numbers in every run of the same replay. A Python call costs the engine about a
microsecond, so fewer calls is less work whatever the machine's load
(`labkit bench sim --calls`).
"""

from __future__ import annotations

import importlib
import sys
import time
from collections import Counter
from contextlib import contextmanager

import pandas as pd

# (module, owner in it (a class, or "" for a module-level name), attributes, group)
ENGINE_PARTS = [
    ("labkit.engine.kv.block_pool", "BlockPool",
     ("allocate", "cache_blocks", "cached_prefix", "free", "touch"), "block pool"),
    ("labkit.engine.kv.kv_manager", "KVManager",
     ("lookup", "allocate", "cache_full_blocks", "free"), "KV manager"),
    # plan_decode_run is looked up where it is called, in instance.py
    ("labkit.engine.instance", "", ("plan_decode_run",), "planning runs"),
    ("labkit.engine.decode_run", "DecodeRun", ("play",), "playing runs"),
    ("labkit.engine.sim.layer_model", "LayerStepModel", ("step_timing",), "cost model"),
    ("labkit.engine.scheduler", "Scheduler", ("schedule",), "single steps"),
    ("labkit.engine.instance", "Instance",
     ("_plan_step", "commit", "sync", "lookup_at", "_emit_steps"), "steps and commits"),
    ("labkit.engine.engine", "Engine", ("_arrive", "replay"), "engine"),
]


class ComponentClock:
    """Exclusive process time and calls per wrapped method (see the module docstring)."""

    def __init__(self, parts=ENGINE_PARTS) -> None:
        self.parts = parts
        self.cpu_s: Counter = Counter()
        self.calls: Counter = Counter()
        self.group: dict[str, str] = {}
        self._inner: list[float] = []  # per open wrapped call: time its wrapped callees took
        self._saved: list[tuple] = []

    def _wrap(self, fn, label: str):
        cpu_s, calls, inner = self.cpu_s, self.calls, self._inner
        clock = time.process_time

        def timed(*args, **kwargs):
            t0 = clock()
            inner.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                spent = clock() - t0
                cpu_s[label] += spent - inner.pop()
                calls[label] += 1
                if inner:
                    inner[-1] += spent  # the caller does not count it as its own

        timed.__wrapped__ = fn
        return timed

    def install(self) -> None:
        for module_name, owner_name, attributes, group in self.parts:
            module = importlib.import_module(module_name)
            owner = getattr(module, owner_name) if owner_name else module
            for name in attributes:
                label = f"{owner_name}.{name}" if owner_name else name
                original = owner.__dict__[name] if owner_name else getattr(module, name)
                self._saved.append((owner, name, original))
                self.group[label] = group
                setattr(owner, name, self._wrap(getattr(owner, name), label))

    def uninstall(self) -> None:
        while self._saved:
            owner, name, original = self._saved.pop()
            setattr(owner, name, original)

    def frame(self) -> pd.DataFrame:
        """One row per component that ran: calls, exclusive CPU seconds, share of all."""
        rows = [{"component": label, "group": self.group[label], "calls": self.calls[label],
                 "cpu_s": self.cpu_s[label]} for label in self.calls]
        df = pd.DataFrame(rows, columns=["component", "group", "calls", "cpu_s"])
        total = df["cpu_s"].sum()
        df["share"] = df["cpu_s"] / total if total > 0 else 0.0
        return df.sort_values("cpu_s", ascending=False, ignore_index=True)


@contextmanager
def component_clock(parts=ENGINE_PARTS):
    """Time the engine's components while the block runs; the methods are restored after."""
    clock = ComponentClock(parts)
    try:
        clock.install()  # (inside: whatever it wrapped before a failure is restored too)
        yield clock
    finally:
        clock.uninstall()


class CallCounter:
    """Calls of Python functions (by code object) and of built-in functions (by name)
    while installed, on the installing thread (see the module docstring)."""

    def __init__(self) -> None:
        self.python: Counter = Counter()
        self.builtin: Counter = Counter()

    def _count(self, frame, event: str, arg) -> None:
        if event == "call":
            self.python[frame.f_code] += 1
        elif event == "c_call":
            self.builtin[_builtin_name(arg)] += 1

    def frame(self) -> pd.DataFrame:
        """One row per function called: kind ("python" / "builtin"), function (a Python
        one as file:line qualified name), calls; most called first."""
        rows = [("python", f"{_short_path(code.co_filename)}:{code.co_firstlineno} "
                           f"{code.co_qualname}", n) for code, n in self.python.items()]
        rows += [("builtin", name, n) for name, n in self.builtin.items()]
        df = pd.DataFrame(rows, columns=["kind", "function", "calls"])
        return df.sort_values(["calls", "function"], ascending=[False, True],
                              ignore_index=True)


def _builtin_name(fn) -> str:
    owner = getattr(fn, "__self__", None)
    qualname = getattr(fn, "__qualname__", None) or repr(fn)
    if owner is None or isinstance(owner, type(sys)):  # a module's function
        return f"{getattr(fn, '__module__', None) or ''}.{qualname}".lstrip(".")
    return qualname  # a method, e.g. "list.append", "ndarray.sum"


def _short_path(filename: str) -> str:
    """A file's path from its package on (labkit/engine/engine.py, numpy/..)."""
    for root in ("labkit", "numpy", "pandas", "numba"):
        at = filename.rfind(f"/{root}/")
        if at >= 0:
            return filename[at + 1 :]
    return filename


@contextmanager
def call_counter():
    """Count the calls the block makes (`CallCounter`); the thread's profiler, if it
    had one, is put back after."""
    counter, previous = CallCounter(), sys.getprofile()
    sys.setprofile(counter._count)
    try:
        yield counter
    finally:
        sys.setprofile(previous)
