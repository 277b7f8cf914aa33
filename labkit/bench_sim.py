"""`labkit bench sim`, part (b): how fast the simulator steps, on two workloads.

- **fast steps, many instances**: a closed-loop AgentX-like replay at concurrency 64
  on qwen3-30b-a3b over 16 independent DP ranks (dp16, h200, max_model_len 262144,
  the trace of `labkit trace gen --kind agentx --sessions 400 --seed 11 --param
  context_window_tokens=200000 --param compact_threshold_tokens=167000`). Steps last
  a few milliseconds, so the simulator's own cost per step is what sweeps wait for;
- **slow steps**: the same kind of replay on deepseek-v3 dep16 with MTP (3 drafts at
  acceptance 2.99), sessions from turn one (160 sessions, seed 0).

Each runs twice in one process: with the step model's exact memo off (the code path
before it, `sim_step_cache=False`) and on (the default). The two must agree bit for bit
(checked and printed). Then the first `STEP_BY_STEP_S` simulated seconds run once more
step by step (no fast-forward, no memo: every step scheduled, priced and committed on its
own, the simulator's reference path, ~1x real time on the fast workload) and once with
the defaults: the speed-up of the default path over it, and that the two agree.
Printed per run: simulated seconds, steps (engine steps, and
rank-steps: rows of the steps table), CPU seconds of this process (the machine may be
shared: CPU time is what a core spent), wall seconds, steps per CPU second, and times
real time (simulated seconds per CPU second).
"""

from __future__ import annotations

import gc
import json
import resource
import time

import numpy as np
import pandas as pd

FAST = dict(model="qwen3-30b-a3b", layout="dp16", hardware="h200", max_model_len=262144)
SLOW = dict(model="deepseek-v3", layout="dep16", hardware="h200", router="session_sticky",
            num_speculative_tokens=3, acceptance_length=2.99, max_model_len=1_048_576)


# the fast workload's trace: generate_agentx_trace(sessions, **FAST_TRACE_KNOBS)
FAST_TRACE_SESSIONS = 400
FAST_TRACE_KNOBS = dict(seed=11, context_window_tokens=200_000, compact_threshold_tokens=167_000)


def fast_workload():
    """(label, engine knobs, trace) of the fast-step workload (trace generated here)."""
    from labkit import generate_agentx_trace

    trace = generate_agentx_trace(FAST_TRACE_SESSIONS, **FAST_TRACE_KNOBS)
    return "qwen3-30b-a3b dp16 (fast steps)", FAST, trace


def workloads():
    """(label, engine knobs, trace) of the two workloads (traces generated here)."""
    from labkit import generate_agentx_trace

    return [fast_workload(),
            ("deepseek-v3 dep16 MTP (slow steps)", SLOW, generate_agentx_trace(160, seed=0))]


# the saturated open-loop load: vLLM's random dataset (`labkit trace gen --kind random
# --num-prompts 2000 --request-rate 16 --input-len 2048 --output-len 512 --range-ratio 0.5
# --seed 0`) on one llama-3.1-8b tp1 h200, past what it serves: ~250 requests run in every
# step and arrivals keep runs short, so the cost per running request per step is what counts
OPEN = dict(model="llama-3.1-8b", layout="tp1", hardware="h200")
OPEN_TRACE_KNOBS = dict(request_rate=16.0, input_len=2048, output_len=512, range_ratio=0.5,
                        seed=0)


def bench_open_loop(num_prompts: int = 2000, repeat: int = 1) -> dict:
    """The saturated open-loop load, `repeat` times: the least CPU time, and how many
    requests a step ran (rank-steps are steps here: one rank)."""
    from labkit.traces import generate_random_trace

    trace = generate_random_trace(num_prompts=num_prompts, **OPEN_TRACE_KNOBS)
    first, cpu, _, median, same = _repeated(OPEN, trace, None, True, repeat, open_loop=True)
    s, steps = first.summary, first.steps
    per_step = float((steps["num_prefill_reqs"] + steps["num_decode_reqs"]).mean())
    print(f"  llama-3.1-8b tp1, {num_prompts} random prompts at 16/s, open loop: "
          f"{s['sim_duration_s']:.0f} sim s, {s['steps']:,} steps of {per_step:.0f} requests "
          f"on average: {cpu:.2f} CPU s (least of {repeat}) = "
          f"{s['sim_duration_s'] / cpu:.0f}x real time (median {median:.2f}; identical: {same})")
    return {"sim_s": s["sim_duration_s"], "steps": s["steps"], "cpu_s": cpu,
            "requests_per_step": per_step, "x_real_time": s["sim_duration_s"] / cpu}


STEP_BY_STEP_S = 30.0  # simulated seconds compared with the step-by-step path


def timed_replay(knobs: dict, trace, duration_s: float | None, cache: bool,
                 fast_forward: bool = True, open_loop: bool = False):
    """One closed-loop c64 replay (`open_loop`: the trace's arrivals instead, to its
    end); (result, CPU seconds, wall seconds)."""
    from labkit import Engine

    engine = Engine(**knobs, sim_step_cache=cache, sim_fast_forward=fast_forward)
    how = dict(open_loop=True) if open_loop else dict(concurrency=64, duration_s=duration_s,
                                                      start_part_way=False)
    # the engines replayed before are garbage in cycles (labkit.memory): collected now,
    # not by a full collection that may fall inside this replay's time
    gc.collect()
    cpu, wall = time.process_time(), time.perf_counter()
    result = engine.replay(trace, **how)
    return result, time.process_time() - cpu, time.perf_counter() - wall


def bench_sim_speed(duration_s: float = 600.0, repeat: int = 1) -> pd.DataFrame:
    """Each workload with the memo off and on, `repeat` times each in this process: the
    row keeps the least CPU time (a shared machine only ever adds to it) and the median;
    the repeats must agree bit for bit."""
    rows = []
    for label, knobs, trace in workloads():
        print(f"  {label}, {duration_s:.0f} sim s:")
        results = {}
        for cache in (False, True):
            result, cpu, wall, median, same = _repeated(knobs, trace, duration_s, cache, repeat)
            results[cache] = result
            row = _row(label, "memo" if cache else "no memo", result, cpu, wall)
            row.update(repeats=repeat, cpu_s_median=median, repeats_identical=same)
            rows.append(row)
            times = f"{cpu:.2f} CPU s ({wall:.2f} wall s)" if repeat == 1 else \
                f"{cpu:.2f} CPU s, least of {repeat} (median {median:.2f}; identical: {same})"
            print(f"    {row['path']:>8}: {row['sim_s']:.0f} sim s, {row['steps']:,} steps "
                  f"({row['rank_steps']:,} rank-steps), {times}: "
                  f"{row['steps_per_s']:,.0f} steps/s, {row['x_real_time']:,.0f}x real time")
        print(f"    speed-up {rows[-2]['cpu_s'] / rows[-1]['cpu_s']:.2f}x; results identical: "
              f"{_identical(results[False], results[True])}")
        rows.append(_against_step_by_step(label, knobs, trace, min(duration_s, STEP_BY_STEP_S)))
    return pd.DataFrame(rows)


def _repeated(knobs: dict, trace, duration_s: float | None, cache: bool, repeat: int,
              open_loop: bool = False):
    """(the first result, the least CPU s and its run's wall s, the median CPU s, whether
    every repeat gave the first's result)."""
    first, cpu, wall = timed_replay(knobs, trace, duration_s, cache, open_loop=open_loop)
    cpus, walls, same = [cpu], [wall], True
    for _ in range(repeat - 1):
        result, cpu, wall = timed_replay(knobs, trace, duration_s, cache, open_loop=open_loop)
        cpus.append(cpu)
        walls.append(wall)
        same = same and _identical(first, result)
        del result  # (one table of each kind held at a time)
    best = min(range(repeat), key=cpus.__getitem__)
    return first, cpus[best], walls[best], float(np.median(cpus)), same


def _against_step_by_step(label: str, knobs: dict, trace, duration_s: float) -> dict:
    """The default path against step by step over the first `duration_s`."""
    slow, slow_cpu, slow_wall = timed_replay(knobs, trace, duration_s, False,
                                             fast_forward=False)
    fast, fast_cpu, _ = timed_replay(knobs, trace, duration_s, True)
    same = _identical(slow, fast)
    print(f"    first {duration_s:.0f} sim s step by step: {slow_cpu:.2f} CPU s, default "
          f"{fast_cpu:.2f}: {slow_cpu / fast_cpu:.1f}x faster; results identical: {same}")
    return {**_row(label, "step by step", slow, slow_cpu, slow_wall),
            "default_speed_up": slow_cpu / fast_cpu, "identical": same}


def bench_sim_breakdown(duration_s: float = 600.0) -> pd.DataFrame:
    """The fast workload once, its CPU time split by engine component (`sim_profile.py`)."""
    from labkit.sim_profile import component_clock

    from labkit.engine.kv.block_pool import load_loops

    label, knobs, trace = fast_workload()
    load_loops()  # (a one-time cost of the process, not of any component: outside)
    before = resource.getrusage(resource.RUSAGE_SELF)
    with component_clock() as clock:
        _, cpu, _ = timed_replay(knobs, trace, duration_s, cache=True)
    after = resource.getrusage(resource.RUSAGE_SELF)
    df = clock.frame()
    print(f"  {label}, {duration_s:.0f} sim s: {cpu:.2f} CPU s, exclusive CPU time by component "
          f"(wrapped methods; the clock's own cost included)")
    # the kernel's share: memory first written (page faults) shows there, in every component
    print(f"    of the process's CPU time, in the kernel: {after.ru_stime - before.ru_stime:.2f} s "
          f"({after.ru_minflt - before.ru_minflt:,} minor page faults)")
    by_group = df.groupby("group", sort=False)["cpu_s"].sum().sort_values(ascending=False)
    for group, seconds in by_group.items():
        print(f"    {group:<18} {seconds:6.2f} s {seconds / df['cpu_s'].sum():6.1%}")
    print("    by method:")
    for row in df.itertuples():
        print(f"      {row.component:<28} {row.calls:>8,} calls {row.cpu_s:6.2f} s "
              f"{row.share:6.1%}")
    return df


def bench_sim_calls(duration_s: float = 600.0, top: int = 25) -> pd.DataFrame:
    """The fast workload's calls (`sim_profile.call_counter`): the same in every run of
    the same code, so a change's effect on the interpreter's work shows exactly where
    the machine's noise hides its CPU time. A short replay first loads what a first
    replay loads (compiled loops, lazily imported modules), which is not counted."""
    from labkit import Engine
    from labkit.sim_profile import call_counter

    label, knobs, trace = fast_workload()
    timed_replay(knobs, trace, min(duration_s, 30.0), cache=True)
    engine = Engine(**knobs, sim_step_cache=True)
    gc.collect()
    with call_counter() as counter:
        result = engine.replay(trace, concurrency=64, duration_s=duration_s,
                               start_part_way=False)
    df = counter.frame()
    python, builtin = (int(df.loc[df["kind"] == k, "calls"].sum()) for k in ("python",
                                                                          "builtin"))
    rank_steps = len(result.steps)
    print(f"  {label}, {duration_s:.0f} sim s ({rank_steps:,} rank-steps): "
          f"{python:,} Python calls ({python / rank_steps:.2f} a rank-step), "
          f"{builtin:,} built-in calls")
    for kind in ("python", "builtin"):
        print(f"    most called, {kind}:")
        for row in df[df["kind"] == kind].head(top).itertuples():
            print(f"      {row.calls:>9,}  {row.function}")
    return df


def _row(label: str, path: str, result, cpu: float, wall: float) -> dict:
    s = result.summary
    return {"workload": label, "path": path, "sim_s": s["sim_duration_s"], "steps": s["steps"],
            "rank_steps": len(result.steps), "cpu_s": cpu, "wall_s": wall,
            "steps_per_s": s["steps"] / cpu, "rank_steps_per_s": len(result.steps) / cpu,
            "x_real_time": s["sim_duration_s"] / cpu}


def _identical(a, b) -> bool:
    """Same tables and summary (NaN equal to NaN; the wall-clock entries aside)."""
    def summary(result) -> str:
        kept = {k: v for k, v in result.summary.items() if k not in ("wall_s", "sim_speed")}
        return json.dumps(kept, sort_keys=True, default=str)

    return a.requests.equals(b.requests) and a.steps.equals(b.steps) and \
        summary(a) == summary(b)
