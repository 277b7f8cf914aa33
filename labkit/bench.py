"""`labkit bench ...`: benchmarks that print figures (never pass/fail tests).

`labkit bench costmodel` prints, per op family, the median and P90 absolute percentage
error of the calibrated cost model on the measured H100 kernels it was fitted on (and on
slices held out of the fit).

`labkit bench layouts` sets up the comparisons practitioners report (DCP vs TP vs DEP
vs PCP, PP, long_prefill_token_threshold, prefill_schedule_interval, routing) and
prints, for each claim, the model's numbers and a verdict read off them (see
`labkit.behaviours`).

`labkit bench sim` measures the simulator itself:

(a) simulated seconds per wall second replaying the Mooncake trace (open loop) on
    llama-3.1-70b, tp8, h200 — read from ../shared/data, skipped if absent;
(b) steps per CPU second and times real time of closed-loop AgentX-like replays at
    concurrency 64: qwen3-30b-a3b dp16 (fast steps, 16 instances) and deepseek-v3
    dep16 with MTP (slow steps), `duration_s` simulated seconds (default 600), each
    step by step, fast-forwarded without the step model's memo, and with both
    (`bench_sim.py`: the speed-ups over step by step, and that all agree), then
    deepseek-v3 sessions started part-way (AgentX's warm start);
(c) times real time of a saturated open-loop load, vLLM's random dataset at 16 requests/s
    on llama-3.1-8b tp1 (~250 requests in every step: the cost per running request);
(d) the cost of a turn's prefix lookup at 1M tokens of context against 10K, for the
    same new tokens. Lookup must follow the new tokens, not the context: ratio ~1.

`labkit bench sim --breakdown` instead replays the fast workload of (b) once and splits
its CPU time by engine component (`labkit.sim_profile`): where to look first when
making the simulator faster. `labkit bench sim --against REF` replays it with this tree
and with the package as it was at git revision REF, alternating, in fresh processes
(`bench_against.py`): a speed-up measured in one sitting against the code it beats.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from labkit.errors import ConfigError


def shared_data_dir() -> Path | None:
    """../shared/data next to the repository (or $LABKIT_SHARED_DATA), if present."""
    candidates = [os.environ.get("LABKIT_SHARED_DATA"),
                  Path.cwd().parent / "shared" / "data",
                  Path(__file__).resolve().parents[2] / "shared" / "data"]
    for c in candidates:
        if c and Path(c).is_dir():
            return Path(c)
    return None


def run_bench(target: str, quick: bool = False, duration_s: float | None = None,
              breakdown: bool = False, against: str | None = None,
              repeat: int | None = None, calls: bool = False) -> int:
    for flag, given in (("--breakdown", breakdown), ("--against", against),
                        ("--repeat", repeat is not None), ("--calls", calls)):
        if given and target != "sim":
            raise ConfigError(f"{flag} applies to `labkit bench sim` only, not {target!r}")
    if sum(map(bool, (breakdown, against, calls))) > 1:
        raise ConfigError("--breakdown, --against and --calls are different runs: give one")
    if repeat is not None and (repeat < 1 or breakdown or calls):
        raise ConfigError(f"--repeat takes a count of runs, 1 or more, and not with "
                          f"--breakdown or --calls (got {repeat})")
    if target == "sim" and against:
        from labkit.bench_against import bench_against

        bench_against(against, duration_s or (120.0 if quick else 600.0), rounds=repeat or 2)
    elif target == "sim" and calls:
        from labkit.bench_sim import bench_sim_calls

        print("labkit bench sim --calls — the function calls the simulator makes")
        bench_sim_calls(duration_s or (120.0 if quick else 600.0))
    elif target == "sim" and breakdown:
        from labkit.bench_sim import bench_sim_breakdown

        print("labkit bench sim --breakdown — where the simulator's CPU time goes")
        bench_sim_breakdown(duration_s or (120.0 if quick else 600.0))
    elif target == "sim":
        bench_sim(quick, duration_s, repeat or 1)
    elif target == "layouts":
        from labkit.behaviours import bench_layouts

        bench_layouts(quick)
    elif target == "costmodel":
        data = shared_data_dir()
        if data is None:
            print("labkit bench costmodel: ../shared/data not found (set LABKIT_SHARED_DATA)")
            return 0
        from labkit.costmodel.bench import bench_costmodel

        bench_costmodel(data)
    elif target == "kernels":
        from labkit.kernels.bench import bench_kernels

        return bench_kernels(quick)
    elif target == "compute":
        bench_compute(quick)
    elif target == "kv":
        from labkit.bench_kv import bench_kv

        bench_kv(quick)
    elif target == "traces":
        from labkit.bench_traces import bench_traces

        bench_traces(quick)
    return 0


def _replay_speed(label: str, engine, trace, **replay_kw) -> dict:
    t0 = time.perf_counter()
    result = engine.replay(trace, **replay_kw)
    wall = time.perf_counter() - t0
    s = result.summary
    speed = s["sim_duration_s"] / wall
    print(f"  {label}: {s['sim_duration_s']:.0f} sim s in {wall:.2f} wall s = {speed:,.0f}x "
          f"real time; {s['requests_completed']} calls, {s['steps']} steps, "
          f"hit rate {s['prefix_cache_hit_rate']:.3f}")
    return {"speed": speed, **s}


def bench_sim(quick: bool = False, duration_s: float | None = None, repeat: int = 1) -> None:
    from labkit import Engine, generate_agentx_trace, load_trace, trace_stats
    from labkit.bench_sim import bench_open_loop, bench_sim_speed

    print("labkit bench sim — simulated seconds per wall second (one run each)")
    data = shared_data_dir()
    print("(a) Mooncake synthetic trace, llama-3.1-70b tp8 h200, open loop")
    if data is None:
        print("  skipped: ../shared/data not found (set LABKIT_SHARED_DATA)")
    else:
        trace = load_trace(data / "traces" / "mooncake_synthetic_trace.jsonl")
        engine = Engine(model="llama-3.1-70b", layout="tp8", hardware="h200",
                        max_model_len=262144)
        _replay_speed("mooncake", engine, trace, open_loop=True)
        print(f"  (implied prefix reuse of the trace: {trace_stats(trace)['prefix_reuse']:.3f}; "
              f"the engine is overloaded, so sharing calls overlap and miss)")

    duration = duration_s or (120.0 if quick else 600.0)
    print("(b) closed-loop AgentX-like replays, concurrency 64, h200: simulator speed "
          "(CPU time of this process)")
    bench_sim_speed(duration, repeat)
    print("  target: >= 500x real time for qwen3-30b-a3b dp16 (goal 1000x)")
    engine = Engine(model="deepseek-v3", layout="dep16", hardware="h200",
                    router="session_sticky", num_speculative_tokens=3,
                    acceptance_length=2.99, max_model_len=1_048_576)
    _replay_speed("deepseek-v3 dep16, part-way start", engine, generate_agentx_trace(160, seed=0),
                  concurrency=64, duration_s=duration, start_part_way=True)

    print("(c) a saturated open-loop load (vLLM's random dataset): CPU time of this process")
    bench_open_loop(500 if quick else 2000, repeat)

    print("(d) prefix lookup of one turn (same 4,096 new tokens), block size 64")
    costs = {ctx: lookup_cost(ctx) for ctx in (10_000, 1_000_000)}
    for ctx, (lookup_us, admit_us) in costs.items():
        print(f"  context {ctx:>9,}: lookup {lookup_us:7.1f} us, "
              f"lookup + allocate + free {admit_us:8.1f} us")
    ratio = costs[1_000_000][0] / costs[10_000][0]
    admit_ratio = costs[1_000_000][1] / costs[10_000][1]
    print(f"  1M / 10K: lookup {ratio:.2f}x (target ~1), admission {admit_ratio:.2f}x "
          f"(ref counts of every reused block are touched, vectorised)")


def lookup_cost(context: int, new_tokens: int = 4096, block_size: int = 64,
                reps: int = 200) -> tuple[float, float]:
    """Microseconds per prefix lookup, and per lookup + allocate + free, of a turn
    extending a cached context of `context` tokens by `new_tokens`."""
    from labkit.engine.kv import KVManager, TraceBlockKeys
    from labkit.engine.request import Request

    total = context + new_tokens
    ids = np.arange(-(-total // block_size), dtype=np.int64)
    kv = KVManager(num_blocks=len(ids) + 16, block_size=block_size)
    parent = Request("parent", "s", context, 1, 0.0,
                     keys=TraceBlockKeys(ids, block_size, block_size))
    assert kv.allocate(parent, context)
    parent.num_computed_tokens = context
    kv.cache_full_blocks(parent)
    hint = kv.free(parent)

    def turn() -> Request:
        return Request("child", "s", total, 1, 0.0, prefix_hint=hint,
                       keys=TraceBlockKeys(ids, block_size, block_size))

    child = turn()
    start = time.perf_counter()
    for _ in range(reps):
        match = kv.lookup(child)
    lookup_us = (time.perf_counter() - start) / reps * 1e6
    assert match.num_tokens == (context // block_size) * block_size
    start = time.perf_counter()
    for _ in range(reps):
        child = turn()
        match = kv.lookup(child)
        kv.allocate(child, total - match.num_tokens, match)
        kv.free(child)
    admit_us = (time.perf_counter() - start) / reps * 1e6
    return lookup_us, admit_us


def bench_compute(quick: bool = False) -> None:
    """The compute plane on this machine: a miniature agentic replay, real tensors,
    measured clock. Prints tokens per wall second and where the time goes; then the
    same replays with ranks as threads and as processes (`executor`), side by side."""
    import torch

    from labkit.traces import TINY_AGENTX, generate_agentx_trace

    device = "cuda" if torch.cuda.is_available() else "cpu"
    trace = generate_agentx_trace(3 if quick else 6, seed=1, block_size=16, **TINY_AGENTX)
    cases = [("tiny-llama", "tp1"), ("tiny-llama", "tp2"), ("tiny-deepseek-v3", "tp1"),
             ("tiny-deepseek-v3", "dcp2"), ("tiny-deepseek-v3", "dep2")]
    if quick:
        cases = cases[:1] + cases[3:4]
    print(f"labkit bench compute — tiny models, {len(trace.requests)} agentic calls, "
          f"{device}, torch threads {torch.get_num_threads()} (one run each)")
    for model, layout in cases:
        _compute_replay(trace, model, layout, device, "threads")
    print("  threads vs processes (executor=threads|mp; mp: one process per GPU, gloo/NCCL)")
    for model, layout in (("tiny-llama", "tp2"), ("tiny-qwen3-moe", "dep2")):
        rates = [_compute_replay(trace, model, layout, device, ex) for ex in ("threads", "mp")]
        print(f"  {model:<17} {layout:<5} processes / threads: {rates[1] / rates[0]:.2f}x")


def _compute_replay(trace, model: str, layout: str, device: str, executor: str) -> float:
    """One replay, one printed line; returns its tokens per wall second."""
    from labkit import Engine

    engine = Engine(model=model, layout=layout, backend="compute", device=device,
                    executor=executor)
    try:
        t0 = time.perf_counter()
        result = engine.replay(trace, concurrency=3, loop_trace=False, max_idle_s=1.0,
                               start_part_way=False)
        wall = time.perf_counter() - t0
    finally:
        engine.data_plane.close()
    table = result.requests
    tokens = int(table.computed_prefill_tokens.sum() + table.output_tokens.sum())
    sec = engine.data_plane.seconds
    control = wall - sec["host"] - sec["forward"]
    print(f"  {model:<17} {layout:<5} {executor:<7} {tokens / wall:8,.0f} tokens/s "
          f"({tokens:,} tokens, {engine.data_plane.steps} steps, {wall:.1f} s): "
          f"forward {sec['forward'] / wall:.0%} (collectives {sec['collectives'] / wall:.0%}),"
          f" host {sec['host'] / wall:.0%}, control plane {control / wall:.0%}")
    return tokens / wall
