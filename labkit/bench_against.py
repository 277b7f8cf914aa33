"""`labkit bench sim --against REF`: the simulator's speed against an earlier version.

A speed-up is only worth quoting against the code it claims to beat, measured on the
same machine in the same sitting (a shared machine's speed drifts by tens of per cent
within an hour). This benchmark takes the `labkit` package as it was at a git
revision (`git archive` into a temporary folder), and replays the fast workload of
`labkit bench sim` (qwen3-30b-a3b dp16, closed loop c64) with it and with this tree,
each in a fresh process, alternating: this tree, REF, this tree, REF, ... Each run
reports the CPU time of its replay and the engine steps it took; the figure of merit is
steps per CPU second (an earlier version may take a few more or fewer steps for the
same simulated time, as its scheduling semantics differed), compared on each code's
least CPU time (a shared machine only ever adds to it; the medians are printed too).

Each process first replays the workload's first minute untimed: a process's first
calls of numba's compiled loops load them from the on-disk cache -- and REF, unpacked
fresh, has no cache: its first process would compile every loop inside the replay,
some ten CPU seconds that are no part of its speed.

The child process only uses what every version since the first replays had:
`labkit.engine.Engine(**knobs)`, `labkit.traces.agentx.generate_agentx_trace`,
`Engine.replay(trace, concurrency=, duration_s=, start_part_way=False)` and the summary's
`steps` and `sim_duration_s`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

from labkit.bench_sim import FAST, FAST_TRACE_KNOBS, FAST_TRACE_SESSIONS
from labkit.errors import ConfigError

_CHILD = """
import gc, json, sys, time
from labkit.engine import Engine
from labkit.traces.agentx import generate_agentx_trace
knobs, sessions, trace_knobs = json.loads(sys.argv[1])
duration_s = float(sys.argv[2])
trace = generate_agentx_trace(sessions, **trace_knobs)
t0 = time.process_time()  # the warm-up: compiled loops loaded (or compiled), modules imported
Engine(**knobs).replay(trace, concurrency=64, duration_s=min(duration_s, 60.0),
                       start_part_way=False)
warmup_s = time.process_time() - t0
engine = Engine(**knobs)
gc.collect()
t0 = time.process_time()
result = engine.replay(trace, concurrency=64, duration_s=duration_s, start_part_way=False)
cpu_s = time.process_time() - t0
print(json.dumps({"cpu_s": cpu_s, "warmup_cpu_s": warmup_s,
                  "steps": int(result.summary["steps"]),
                  "sim_s": float(result.summary["sim_duration_s"])}))
"""


def source_tree() -> Path:
    """The folder holding this `labkit` package: a git checkout, or an error saying so."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"],
                          capture_output=True, text=True)
    if done.returncode or Path(done.stdout.strip()).resolve() != root:
        raise ConfigError(f"--against needs labkit run from its git checkout (an editable "
                          f"install, `pip install -e .`); {root} is not one")
    return root


def checkout(root: Path, ref: str, into: Path) -> str:
    """`labkit/` at `ref` unpacked under `into`; returns the revision's short hash."""
    done = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "--verify",
                           f"{ref}^{{commit}}"], capture_output=True, text=True)
    if done.returncode:
        raise ConfigError(f"--against {ref!r}: not a revision of {root} "
                          f"({done.stderr.strip() or 'git rev-parse failed'})")
    sha = done.stdout.strip()
    archive = subprocess.run(["git", "-C", str(root), "archive", "--format=tar", sha, "labkit"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return sha


def _run(path: Path, duration_s: float) -> dict:
    env = {**os.environ, "PYTHONPATH": str(path)}
    workload = json.dumps([FAST, FAST_TRACE_SESSIONS, FAST_TRACE_KNOBS])
    done = subprocess.run([sys.executable, "-c", _CHILD, workload, str(duration_s)],
                          env=env, cwd=path, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the replay with the code in {path} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench_against(ref: str, duration_s: float = 600.0, rounds: int = 2) -> pd.DataFrame:
    """Alternated replays of the fast workload, this tree and `ref`; one row per run."""
    root = source_tree()
    rows = []
    with tempfile.TemporaryDirectory(prefix="labkit-against-") as tmp:
        sha = checkout(root, ref, Path(tmp))
        print(f"labkit bench sim --against {ref} — this tree's speed against {ref}'s")
        print(f"  qwen3-30b-a3b dp16 (fast steps), {duration_s:.0f} sim s, fresh processes, "
              f"alternated: this tree ({root}) and {ref} ({sha})")
        for round_ in range(rounds):
            for code, path in (("this tree", root), (f"{ref}", Path(tmp))):
                run = _run(path, duration_s)
                run["steps_per_cpu_s"] = run["steps"] / run["cpu_s"]
                rows.append({"code": code, "round": round_, **run})
                print(f"    {code:>12}: {run['cpu_s']:7.2f} CPU s, {run['steps']:,} steps "
                      f"({run['steps_per_cpu_s']:,.0f} steps per CPU s)")
    df = pd.DataFrame(rows)
    rate = df.groupby("code", sort=False)["steps_per_cpu_s"]
    best, median = rate.max(), rate.median()
    print(f"  this tree takes {best.iloc[0] / best.iloc[1]:.2f}x the steps per CPU second "
          f"of {ref} (least CPU time of each; medians: {median.iloc[0] / median.iloc[1]:.2f}x)")
    return df
