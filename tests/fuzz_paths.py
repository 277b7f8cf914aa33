"""Differential fuzzing of the simulator's paths: one replay, two ways, bit for bit.

The simulator has a reference path — every step scheduled, priced and committed on its
own — and others that must give the same tables and summary: fast-forwarded runs
(`sim_fast_forward`), the step model's memo (`sim_step_cache`), a replay driven by hand
in slices as notebooks drive it (`--against drive`), and the compute plane on the
predicted clock, whose real tensors change only the tokens (`--against compute`: tiny
presets, their own generator `random_compute_case`); and on the compute plane, ranks as
processes against ranks as threads (`--against mp`), and the tokens a layout generates
against one GPU's (`--against tp1`). A random case is a
preset, a legal layout (PP, DCP, PCP, KVPP and EP among them), random knobs (budget,
chunking, drafts, async scheduling, tight pools, routers, offload tiers, block sizes,
CUDA-graph modes, MoE routing skew, a short max_model_len with oversized calls
skipped), a random load (an AgentX-like closed loop, or open-loop random /
shared-prefix / multi-turn traffic), on one engine or a P/D pair of groups, and
sometimes subscribers to a few engine events (which turn batched KV work and runs'
leaving off). Each is replayed both ways and compared: requests, steps and summary
(wall-clock entries aside), and how many events of each kind came.

    python tests/fuzz_paths.py SEED SECONDS [--against step|memo|drive|compute|mp|tp1]
                               [--pd] [--out DIR]

runs random cases for SECONDS, prints a line per case that differs or crashes, and
pickles each such case (knobs, trace, replay options) into DIR for `replay_case`.
`tests/engine/test_fuzz_paths.py` and `tests/compute/test_predicted_clock.py` run a few
fixed seeds of it in the suite; `fuzz_revision.py` replays its cases with this tree
against a git revision (for changes to code both paths share). Sessions 25-29 found
seven engine bugs with it (NOTES.md). A process keeps native memory for each distinct
model, layout and feature it meets (~7 MB a case on average; a case replayed again adds
nothing): run it in chunks of ~20 minutes rather than for hours.
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
import random
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from labkit import Engine, generate_agentx_trace  # noqa: E402
from labkit.engine import events  # noqa: E402
from labkit.engine.disagg import PDEngine  # noqa: E402
from labkit.engine.replay import start_replay  # noqa: E402
from labkit.errors import ConfigError  # noqa: E402
from labkit.specs.config import CUDAGRAPH_MODES, MOE_ROUTINGS, ROUTER_POLICIES  # noqa: E402
from labkit.traces import (TINY_AGENTX, generate_multi_turn_trace,  # noqa: E402
                           generate_random_trace, generate_shared_prefix_trace)
from tests.support import SMALL_AGENTX, FixedStepCost  # noqa: E402

MODELS = ["llama-3.1-8b", "qwen3-30b-a3b", "gpt-oss-120b", "qwen3-14b", "mixtral-8x7b",
          "deepseek-v3", "kimi-linear-48b-a3b", "tiny-llama", "tiny-qwen3-moe",
          "tiny-deepseek-v3", "tiny-deepseek-v3.2", "tiny-kimi-linear", "tiny-gpt-oss"]
LAYOUTS = ["tp1", "tp2", "tp4", "dp2", "dp3", "dp4", "dp8", "dp16", "tp2xdp2", "tp8xdp2",
           "dep4", "dep8", "pp2", "tp2xpp2", "dp2xpp2", "dep4xpp2", "dcp2", "tp4xdcp2",
           "tp2xdcp2xdp2", "dep8xdcp2", "pcp2", "pcp2xdcp2", "tp2xkvpp2", "tp2xep2",
           "dp2xtp2xep4"]
PD_LAYOUTS = ["tp1", "tp2", "tp4", "dp2", "dp4", "tp2xdp2", "dep4", "pp2", "dcp2", "pcp2"]
# events a case may subscribe to (a subscriber changes the paths taken: no batched KV
# work, no leaving runs): how many of each came must agree between the paths, but for
# the last two (one per run or per step)
COUNTED = ("RequestArrived", "RequestScheduled", "RequestPreempted", "FirstToken",
           "RequestFinished", "BlocksAllocated", "BlocksFreed", "BlocksCached",
           "BlocksEvicted", "CacheHit", "KVFetched", "KVOffloaded", "KVLoaded")
WATCHED = COUNTED + ("StepStarted", "RequestTokens")
# the summary's wall-clock entries, and the plane's name (`--against compute`)
UNCOMPARED = ("wall_s", "sim_speed", "backend")


def random_case(rng: random.Random, pd: bool = False) -> dict:
    """A case: {"pd", "model", "knobs", "trace" (kind and arguments), "replay"}."""
    pick = rng.random
    knobs = dict(hardware=rng.choice(["h200", "h100"]))
    for name, p, values in (
            ("max_num_batched_tokens", .3, [512, 2048, 4096, 16384]),
            ("long_prefill_token_threshold", .3, [13, 64, 256, 1024]),  # (13: chunks
            # by the dozen, so recomputed streams end every way: session 33)
            ("max_num_seqs", .25, [2, 4, 8, 32]),
            ("num_gpu_blocks_override", .35, [800, 1500, 3000, 8000]),
            ("scheduling_policy", .15, ["fcfs", "priority"]),
            ("async_scheduling", .2, [False, True]),
            ("cpu_kv_gib", .25, [0.002, 0.01, 0.1, 2.0]),
            ("block_size", .15, [8, 16, 32]),
            ("prefill_schedule_interval", .1, [1, 2, 4]),
            ("kv_cache_dtype", .1, ["fp8"]),
            ("cudagraph_mode", .1, list(CUDAGRAPH_MODES)),
            ("moe_routing", .1, list(MOE_ROUTINGS)),
            ("enable_prefix_caching", .05, [False]),
            ("enable_chunked_prefill", .08, [False]),
            ("session_kv_migration", .15, ["recompute"]),
            ("kv_layout", .1, ["packed"]),
            ("max_cudagraph_capture_size", .08, [8, 64]),
            ("gpu_memory_utilization", .08, [0.5, 0.95]),
            ("seed", .1, [1, 7])):
        if pick() < p:
            knobs[name] = rng.choice(values)
    if pick() < .1:
        knobs["max_model_len"] = rng.choice([2048, 8192])
    if knobs.get("cpu_kv_gib") and pick() < .3:
        knobs["disk_kv_gib"] = rng.choice([0.05, 1.0])
    if knobs.get("cpu_kv_gib") and pick() < .3:
        knobs["kv_offload_eviction"] = "arc"
    if pd:
        knobs.update(prefill_layout=rng.choice(PD_LAYOUTS), decode_layout=rng.choice(PD_LAYOUTS),
                     num_prefill=rng.randint(1, 2), num_decode=rng.randint(1, 2))
        if pick() < .3:
            knobs["decode_knobs"] = dict(num_speculative_tokens=2, acceptance_length=2.5)
    else:
        knobs["layout"] = rng.choice(LAYOUTS)
        if pick() < .5:
            knobs["router"] = rng.choice(list(ROUTER_POLICIES))
        if pick() < .25:
            drafts = rng.choice([1, 2, 3])
            knobs.update(num_speculative_tokens=drafts,
                         acceptance_length=round(1 + drafts * rng.choice([0.5, 0.8, 1.0]), 2))
    seed = rng.randint(0, 10**6)
    kind = rng.choice(["agentx", "agentx", "random", "shared-prefix", "multi-turn"])
    rate, burst = rng.choice([2.0, 8.0, 30.0]), rng.choice([0.5, 1.0, 3.0])
    if kind == "agentx":
        trace = dict(sessions=rng.randint(3, 12), seed=seed,
                     block_size=rng.choice([16, 64, 64, 512]))  # (512: Mooncake's)
        replay = dict(concurrency=rng.choice([2, 4, 8, 16]), start_part_way=pick() < .4)
        if pick() < .1:
            replay["loop_trace"] = False
    elif kind == "random":
        trace = dict(num_prompts=rng.randint(20, 120), input_len=rng.choice([256, 1024, 3000]),
                     output_len=rng.choice([16, 64, 200]), range_ratio=rng.choice([0, .5]),
                     prefix_len=rng.choice([0, 200]), request_rate=rate, burstiness=burst,
                     seed=seed, block_size=16)
        replay = dict(open_loop=True)
    elif kind == "shared-prefix":
        trace = dict(num_groups=rng.randint(2, 6), prompts_per_group=rng.randint(3, 10),
                     system_prompt_len=rng.choice([500, 2000]),
                     question_len=rng.choice([50, 300]), output_len=rng.choice([30, 150]),
                     request_rate=rate, burstiness=burst, seed=seed, block_size=16)
        replay = dict(open_loop=True)
    else:
        trace = dict(num_sessions=rng.randint(3, 15), turns=rng.randint(2, 6),
                     system_prompt_len=rng.choice([0, 400]), input_len=rng.choice([100, 500]),
                     output_len=rng.choice([30, 150]), think_time_s=rng.choice([0.0, 1.0]),
                     request_rate=rate, burstiness=burst, seed=seed, block_size=16)
        replay = dict(open_loop=True)
    replay.update(duration_s=rng.choice([10, 30, 60, 120]), max_idle_s=2.0)
    if pick() < .15:
        replay.update(warmup_s=rng.choice([1.0, 5.0]), slo="ttft=1,tpot=0.05",
                      percentiles=(50, 99.9), gpu_hour_usd=2.5)
    if "max_model_len" in knobs:
        replay["on_oversize"] = "skip"
    watch = sorted(rng.sample(WATCHED, rng.randint(1, 4))) if pick() < .25 else []
    model = rng.choice(MODELS)
    _model_knobs(rng, model, knobs)
    return dict(pd=pd, model=model, knobs=knobs, trace=(kind, trace), replay=replay,
                watch=watch)


def _model_knobs(rng: random.Random, model: str, knobs: dict) -> None:
    """Knobs only some models or layouts take (others refuse them: a wasted case)."""
    if "deepseek-v3.2" in model and rng.random() < .3:  # a sparse indexer (DSA)
        knobs["hisparse_buffer_tokens"] = rng.choice([256, 1024])
        if rng.random() < .3:
            knobs["hisparse_host_gib"] = rng.choice([0.001, 0.05])
    if "kimi-linear" in model and rng.random() < .4:  # linear-attention state
        knobs["linear_state_retention"] = rng.choice(["interval", "selective", "none"])
    if "dcp" in knobs.get("layout", "") and rng.random() < .4:
        knobs["dcp_kv_cache_interleave_size"] = rng.choice([8, 64])
    if "ep" in knobs.get("layout", "") and rng.random() < .2:
        knobs.update(enable_eplb=True, num_redundant_experts=rng.choice([4, 16, 32]))


# The compute plane on the predicted clock (`clock="predicted"`) must schedule exactly as
# the sim: a tiny preset's real tensors on the CPU change the tokens, nothing else.
TINY = [m for m in MODELS if m.startswith("tiny-")]
COMPUTE_LAYOUTS = ["tp1", "tp2", "tp4", "dp2", "tp2xdp2", "dep2", "dep4", "pp2", "tp2xpp2",
                   "dcp2", "pcp2", "pcp2xdcp2", "tp2xep2"]
COMPUTE_PD_LAYOUTS = ["tp1", "tp2", "dp2", "pp2", "dcp2", "pcp2"]


def random_compute_case(rng: random.Random, pd: bool = False) -> dict:
    """A case for `--against compute`: a tiny preset, a layout of up to 4 GPUs, knobs
    sized to its small pools, a tiny AgentX-like trace run once through (no speculative
    decoding: the real model decides which drafts it accepts)."""
    pick = rng.random
    knobs = dict(num_gpu_blocks_override=rng.choice([30, 60, 200]))
    for name, p, values in (
            ("max_num_batched_tokens", .3, [32, 64, 256]),
            ("long_prefill_token_threshold", .2, [16, 48]),
            ("max_num_seqs", .2, [2, 4]),
            ("scheduling_policy", .15, ["priority"]),
            ("async_scheduling", .3, [False]),
            ("prefill_schedule_interval", .1, [2]),
            ("cpu_kv_gib", .25, [0.0005, 0.005]),
            ("block_size", .15, [8, 32]),
            ("enable_prefix_caching", .08, [False]),
            ("enable_chunked_prefill", .08, [False]),
            ("session_kv_migration", .15, ["recompute"]),
            ("kv_layout", .1, ["packed"])):
        if pick() < p:
            knobs[name] = rng.choice(values)
    if knobs.get("cpu_kv_gib") and pick() < .3:
        knobs["disk_kv_gib"] = 0.001
    if knobs.get("cpu_kv_gib") and pick() < .3:
        knobs["kv_offload_eviction"] = "arc"
    if pd:
        knobs.update(prefill_layout=rng.choice(COMPUTE_PD_LAYOUTS),
                     decode_layout=rng.choice(COMPUTE_PD_LAYOUTS))
    else:
        knobs["layout"] = rng.choice(COMPUTE_LAYOUTS)
        if pick() < .4:
            knobs["router"] = rng.choice(list(ROUTER_POLICIES))
    model = rng.choice(TINY)
    _model_knobs(rng, model, knobs)
    if pick() < .5:
        knobs["cost_model"] = "fixed"  # (`FixedStepCost`: 10 ms a step; else the preset's)
    trace = dict(sessions=rng.randint(2, 4), seed=rng.randint(0, 10**6), block_size=16,
                 output_median=40.0, output_max=80, context_window_tokens=400,
                 compact_threshold_tokens=280)
    replay = dict(concurrency=rng.choice([2, 4]), loop_trace=False, max_idle_s=1.0,
                  start_part_way=pick() < .3)
    return dict(pd=pd, model=model, knobs=knobs, trace=("tiny-agentx", trace), replay=replay,
                watch=[])


def make_trace(kind: str, args: dict):
    if kind == "tiny-agentx":
        args = dict(args)
        n, seed, size = args.pop("sessions"), args.pop("seed"), args.pop("block_size")
        return generate_agentx_trace(n, seed=seed, block_size=size, **dict(TINY_AGENTX, **args))
    if kind == "agentx":
        args = dict(args)
        return generate_agentx_trace(args.pop("sessions"), **args, **SMALL_AGENTX)
    return {"random": generate_random_trace, "shared-prefix": generate_shared_prefix_trace,
            "multi-turn": generate_multi_turn_trace}[kind](**args)


def replay_case(case: dict, trace=None, counts: Counter | None = None, drive=None, **path):
    """The case's replay with the path knobs given (sim_fast_forward, sim_step_cache);
    `counts`: filled with how many of each event the case watches came (by name);
    `drive`: a random.Random to drive the replay by hand with (`drive_replay`)."""
    trace = make_trace(*case["trace"]) if trace is None else trace
    cls = PDEngine if case["pd"] else Engine
    knobs = dict(case["knobs"])
    if knobs.get("cost_model") == "fixed":
        knobs["cost_model"] = FixedStepCost()
    engine = cls(case["model"], **knobs, **path)
    kinds = [getattr(events, name) for name in case.get("watch", ())]
    buses = [e.events for e in engine.prefill + engine.decode] if case["pd"] else [engine.events]
    seen = Counter() if counts is None else counts  # (the subscriber changes the paths)
    for bus in buses if kinds else ():
        bus.subscribe(lambda ev: seen.update([type(ev).__name__]), *kinds)
    if drive is not None:
        return drive_replay(engine, trace, case["replay"], drive)
    return engine.replay(trace, **case["replay"])


def drive_replay(engine, trace, options: dict, rng: random.Random):
    """The replay driven by hand, as notebooks do: set up (`start_replay`), then slices
    of random length — `step()` until a time (the dashboards' way: the run's end stays
    where it is) or `run_until` it (which ends the runs planned at the slice's end) —
    with the tables read now and then between them, and `finish()`."""
    run = start_replay(engine, trace, **options)
    end, t = options["duration_s"], 0.0
    until = rng.random() < .5
    while t < end and engine.has_events(before=math.inf):
        t += rng.choice([0.01, 0.2, 1.0, 4.0])
        if until:
            engine.run_until(min(t, end))
        else:
            while engine.now < t and engine.step():
                pass
        if rng.random() < .3:
            run.result()
    return run.finish()


PATHS = {"step": (dict(sim_fast_forward=False), {}),  # reference, then the default
         "memo": (dict(sim_step_cache=False), {}),
         "drive": ({}, dict(drive=True)),  # one call, then driven by hand
         "compute": (dict(backend="sim"), dict(backend="compute", clock="predicted")),
         "mp": (dict(backend="compute", clock="predicted"),  # ranks as threads, then as
                dict(backend="compute", clock="predicted", executor="mp")),  # processes
         "tp1": (dict(backend="compute", clock="predicted"),) * 2}  # (`on_one_gpu`)


def differs(a, b, counts=(Counter(), Counter())) -> list[str]:
    """What differs between two results: "requests", "steps", summary keys, and the
    counts of events (`replay_case`'s) where the paths must agree on them."""
    out = [name for name in ("requests", "steps")
           if not _table(a, b, name).equals(_table(b, a, name))]
    keys = (set(a.summary) | set(b.summary)) - set(UNCOMPARED)
    out += sorted(k for k in keys if json.dumps(a.summary.get(k), default=str)
                  != json.dumps(b.summary.get(k), default=str))
    out += [f"events {k}: {counts[0][k]} vs {counts[1][k]}" for k in COUNTED
            if counts[0][k] != counts[1][k]]
    return out


def _table(result, other, name: str):
    """A result's table, but the compute plane's tokens where the other has none (the
    sim)."""
    table = getattr(result, name)
    return table.drop(columns=list(set(table) - set(getattr(other, name))))


def on_one_gpu(case: dict) -> dict:
    """The case on one GPU (tp1), without the knobs of its layout."""
    knobs = {k: v for k, v in case["knobs"].items() if k not in (
        "router", "dcp_kv_cache_interleave_size", "enable_eplb", "num_redundant_experts")}
    return dict(case, knobs=dict(knobs, layout="tp1"))


def other_tokens(a, b) -> list[str]:
    """The calls both replays ran to the end whose generated tokens differ."""
    done = [r.set_index("request_id") for r in (a.requests, b.requests)]
    done = [d.loc[d["completed"].astype(bool), "output_token_ids"] for d in done]
    both = done[0].index.intersection(done[1].index)
    if len(both) < min(len(d) for d in done):
        return ["calls completed"]
    return [f"tokens of {rid}" for rid in both
            if list(done[0][rid]) != list(done[1][rid])][:5]


def check_case(case: dict, against: str = "step") -> list[str] | None:
    """What differs between the case's replay on the reference path and the default;
    None where the case's knobs are refused (a ConfigError: not a legal case)."""
    trace = make_trace(*case["trace"])
    counts = (Counter(), Counter())
    drive = random.Random(case["trace"][1]["seed"])  # (how a driven replay is sliced)
    paths = [dict(p, drive=drive) if "drive" in p else p for p in PATHS[against]]
    cases = (case, on_one_gpu(case)) if against == "tp1" else (case, case)
    try:
        results = [replay_case(c, trace, seen, **path)
                   for c, seen, path in zip(cases, counts, paths)]
    except ConfigError:
        return None
    return other_tokens(*results) if against == "tp1" else differs(*results, counts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("seed", type=int)
    ap.add_argument("seconds", type=float)
    ap.add_argument("--against", choices=list(PATHS), default="step")
    ap.add_argument("--pd", action="store_true", help="P/D pairs of groups")
    ap.add_argument("--out", type=Path, default=Path("fuzz-cases"))
    args = ap.parse_args()
    if args.pd and args.against == "tp1":
        ap.error("--against tp1 compares one engine's layouts (no --pd)")
    rng, end = random.Random(args.seed), time.time() + args.seconds
    done = refused = bad = 0
    while time.time() < end:
        plane = args.against in ("compute", "mp", "tp1")
        case = (random_compute_case if plane else random_case)(rng, args.pd)
        try:
            diff = check_case(case, args.against)
        except Exception:  # noqa: BLE001 — a crash is a finding, reported with the case
            diff = ["crash: " + traceback.format_exc(limit=3)]
        if diff is None:
            refused += 1
            continue
        done += 1
        if diff:
            bad += 1
            args.out.mkdir(exist_ok=True)
            path = args.out / f"case-{args.seed}-{done}.pkl"
            path.write_bytes(pickle.dumps(case))
            print(f"DIFF {diff} {case['model']} {case['knobs']} {case['trace']} "
                  f"{case['replay']} -> {path}", flush=True)
    print(f"{done} cases compared ({refused} refused by their knobs), {bad} differ")


if __name__ == "__main__":
    main()
