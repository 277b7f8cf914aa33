"""How much of a replay is compiled work: the simulator's floor as its Python stands.

`labkit bench sim --breakdown` splits a replay's CPU time by engine component; each
component mixes Python with the compiled (numba) loops it calls, and those loops do
the per-block KV work (allocations evicting keys, registrations, frees, prefix walks)
that no rewrite of the Python around them removes. This script times the compiled
calls themselves: every numba dispatcher in `labkit` is wrapped (at each module-level
name that holds it) in a timer, after one replay has compiled every loop the workload
reaches (a loop compiled later would see a wrapper where it expects a dispatcher);
then the fast workload of `labkit bench sim` is replayed and each loop's calls and
seconds are printed — their sum is what the replay would cost with no Python at all.

    python tests/compiled_share.py [SIM_SECONDS]

Measured (NOTES.md, session 37): 1.26-1.34 s of a 4.3-4.7 s replay of 600 sim s (29 %)
in ~80K compiled calls, the block pool's and key index's loops about half of it. (A dev
tool like `fuzz_paths.py`, not a test: it rebinds names module-wide for its process.)
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import time
from collections import Counter

from numba.core.registry import CPUDispatcher

import labkit
from labkit.bench_sim import fast_workload, timed_replay


def wrap_dispatchers(calls: Counter, seconds: Counter) -> int:
    """Put a timer around every labkit numba dispatcher, wherever a module names it."""
    modules = []
    for info in pkgutil.walk_packages(labkit.__path__, "labkit."):
        if not info.name.endswith("__main__"):
            try:
                modules.append(importlib.import_module(info.name))
            except ImportError:  # (an optional extra: Ray, triton)
                pass
    timers = {}
    for module in modules:
        for name, obj in list(vars(module).items()):
            if isinstance(obj, CPUDispatcher) and obj.__module__.startswith("labkit"):
                if id(obj) not in timers:
                    timers[id(obj)] = _timer(obj, f"{obj.__module__}.{obj.__name__}",
                                             calls, seconds)
                setattr(module, name, timers[id(obj)])
    return len(timers)


def _timer(fn, label: str, calls: Counter, seconds: Counter):
    clock = time.process_time

    def timed(*args):
        t0 = clock()
        out = fn(*args)
        seconds[label] += clock() - t0
        calls[label] += 1
        return out
    return timed


def main(sim_s: float = 600.0) -> None:
    _, knobs, trace = fast_workload()
    timed_replay(knobs, trace, sim_s, True)  # compiles (or loads) every loop it reaches
    calls, seconds = Counter(), Counter()
    loops = wrap_dispatchers(calls, seconds)
    _, cpu, _ = timed_replay(knobs, trace, sim_s, True)
    total = sum(seconds.values())
    print(f"fast workload, {sim_s:.0f} sim s: {cpu:.2f} CPU s; in {loops} compiled loops: "
          f"{total:.2f} s ({total / cpu:.0%}) in {sum(calls.values()):,} calls")
    for label, s in seconds.most_common(25):
        print(f"  {s:6.3f} s {calls[label]:>8,} calls {s / calls[label] * 1e6:7.1f} us  {label}")


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 600.0)
