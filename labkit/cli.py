"""`labkit ...`: the command line.

    labkit trace gen --kind agentx --sessions N --seed S [--tiny] --out FILE.jsonl
    labkit trace stats FILE [--format auto|labkit|mooncake] [--json]
    labkit replay --trace FILE --model M --layout L --hardware H [knobs...] [--out DIR] [--json]
                  [--backend sim|compute [--device cpu|cuda] [--clock measured|predicted]]
    labkit capacity --model M --layout L --hardware H --context N [--json]
    labkit sweep NOTEBOOK -p NAME V1,V2 [-p ...] --out DIR [--jobs J]
    labkit pd profile | sweep ...   (prefill/decode rate matching: see experiments/pd_cli.py)
    labkit bench sim | costmodel | layouts | kernels | compute | kv

Every `EngineConfig` knob is a `replay` flag (``--max-num-batched-tokens``, ...), built
from the dataclass so the two never drift apart. Mistakes (a malformed trace, an
unknown preset, a knob out of range, a request that can never fit) are reported on
stderr before anything runs, with exit code 2, and nothing is written.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import types
import typing

from labkit.errors import ConfigError
from labkit.traces.validate import TraceError
from labkit.specs.config import knob_fields
from labkit.specs.hardware import HARDWARE_PRESETS
from labkit.specs.model_presets import MODEL_PRESETS

# Flags whose names the interface fixes differently from the knob they set.
KNOB_ALIASES = {"num_gpu_blocks_override": ["--num-gpu-blocks"]}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _knob_type(annotation):
    """int | None -> int; bool stays bool."""
    if isinstance(annotation, str):
        annotation = eval(annotation, {"int": int, "float": float, "str": str, "bool": bool})
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0]
    return annotation


def add_knob_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine knobs (vLLM names)")
    for name, annotation, default, help_text, choices in knob_fields():
        kind = _knob_type(annotation)
        flags = [_flag(name)] + KNOB_ALIASES.get(name, [])
        if default is not None:
            help_text = f"{help_text} (default: {default})"
        if kind is bool:
            group.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction,
                               default=None, help=help_text)
        else:
            group.add_argument(*flags, dest=name, type=kind, choices=choices, default=None,
                               metavar=name.upper() if not choices else None, help=help_text)


def knobs_from_args(args) -> dict:
    return {name: getattr(args, name) for name, *_ in knob_fields()
            if getattr(args, name) is not None}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="labkit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    trace = sub.add_parser("trace", help="generate traces and describe them")
    tsub = trace.add_subparsers(dest="trace_command", required=True)
    gen = tsub.add_parser("gen", help="generate a synthetic trace")
    gen.add_argument("--kind", choices=["agentx"], default="agentx")
    gen.add_argument("--sessions", type=int, required=True)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--block-size", type=int, help="tokens per block id (default 64; "
                                                     "16 with --tiny, the tiny models' own)")
    gen.add_argument("--tiny", action="store_true",
                     help="miniature token counts (labkit.traces.TINY_AGENTX), for the "
                          "compute backend on a CPU; --param still overrides")
    gen.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                     help="a generator knob (see labkit.traces.AgentXParams), repeatable, "
                          "e.g. --param context_window_tokens=200000")
    gen.add_argument("--out", required=True)
    stats = tsub.add_parser("stats", help="statistics of a trace")
    stats.add_argument("file")
    stats.add_argument("--format", choices=["auto", "labkit", "mooncake"], default="auto")
    stats.add_argument("--json", action="store_true")

    replay = sub.add_parser("replay", help="replay a trace against a simulated deployment")
    replay.add_argument("--trace", required=True)
    replay.add_argument("--format", choices=["auto", "labkit", "mooncake"], default="auto")
    replay.add_argument("--model", required=True,
                        help=f"one of {', '.join(MODEL_PRESETS)}, or a Hugging Face "
                             "config.json or model folder")
    replay.add_argument("--layout", default="tp1", help="e.g. tp8, dp8, dep16, tp4xpp2")
    replay.add_argument("--hardware", default="h200", choices=sorted(HARDWARE_PRESETS))
    replay.add_argument("--backend", default="sim", choices=["sim", "compute"],
                        help="sim: steps take what the cost model says; compute: real "
                             "tensors (tiny-* models on a CPU)")
    replay.add_argument("--device", choices=["cpu", "cuda"],
                        help="compute backend: where the tensors live (default cpu)")
    replay.add_argument("--clock", choices=["measured", "predicted"],
                        help="compute backend: step durations as measured (default) or as "
                             "the cost model predicts them")
    replay.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "float64"],
                        help="compute backend: weights, activations and KV (default float32)")
    replay.add_argument("--checkpoint", help="compute backend: a local safetensors file or "
                                             "folder (an HF checkpoint folder) instead of "
                                             "seeded random weights")
    replay.add_argument("--cost-model", default="calibrated", choices=["calibrated", "roofline"],
                        help="step times: kernels fitted on measured H100 latencies "
                             "(default), or a first-order roofline")
    loop = replay.add_mutually_exclusive_group(required=True)
    loop.add_argument("--concurrency", type=int, help="closed loop: sessions in flight")
    loop.add_argument("--open-loop", action="store_true", help="arrive at trace timestamps")
    replay.add_argument("--duration-s", type=float, help="simulated seconds to run")
    replay.add_argument("--warmup-s", type=float, default=0.0,
                        help="exclude calls arriving before this from the summary")
    replay.add_argument("--max-idle-s", type=float, help="cap on tool gaps (closed loop)")
    replay.add_argument("--start-part-way", action=argparse.BooleanOptionalAction,
                        default=True, help="start the first sessions at a random turn")
    replay.add_argument("--loop-trace", action=argparse.BooleanOptionalAction, default=True,
                        help="closed loop: start over with fresh ids when sessions run out")
    replay.add_argument("--out", help="write requests.parquet, steps.parquet, summary.json")
    replay.add_argument("--json", action="store_true", help="print the summary as JSON")
    replay.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress bar (default: on for a terminal)")
    add_knob_flags(replay)

    cap = sub.add_parser("capacity", help="what a request costs under a layout, how many fit")
    cap.add_argument("--model", required=True,
                     help="a preset, or a Hugging Face config.json or model folder")
    cap.add_argument("--layout", required=True, help="a layout, or several separated by commas")
    cap.add_argument("--hardware", default="h200", choices=sorted(HARDWARE_PRESETS))
    cap.add_argument("--context", type=int, required=True, help="tokens of one request")
    cap.add_argument("--kv-dtype", choices=["bf16", "fp8"], default="bf16")
    cap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    cap.add_argument("--num-speculative-tokens", type=int, default=0,
                     help="MTP drafts (their layers' weights and KV count too)")
    cap.add_argument("--json", action="store_true")

    from labkit.experiments.cli import add_sweep_parser

    add_sweep_parser(sub)
    from labkit.experiments.pd_cli import add_pd_parser

    add_pd_parser(sub, add_knob_flags)

    bench = sub.add_parser("bench", help="benchmarks that print figures")
    bench.add_argument("target",
                       choices=["sim", "costmodel", "layouts", "kernels", "compute", "kv"])
    bench.add_argument("--quick", action="store_true", help="smaller runs")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "trace":
            return _trace(args)
        if args.command == "replay":
            return _replay(args)
        if args.command == "capacity":
            return _capacity(args)
        if args.command == "sweep":
            from labkit.experiments.cli import run_sweep_command

            return run_sweep_command(args)
        if args.command == "pd":
            from labkit.experiments.pd_cli import run_pd_command

            return run_pd_command(args, knobs_from_args(args))
        if args.command == "bench":
            from labkit.bench import run_bench

            return run_bench(args.target, quick=args.quick)
    except (ConfigError, TraceError, OSError) as err:
        print(f"labkit: error: {err}", file=sys.stderr)
        return 2
    return 0


def _trace(args) -> int:
    from labkit.traces import generate_agentx_trace, load_trace, trace_stats, write_trace

    if args.trace_command == "gen":
        if args.sessions < 1:
            raise ConfigError(f"--sessions {args.sessions} must be >= 1")
        from labkit.traces import TINY_AGENTX

        knobs = {**(TINY_AGENTX if args.tiny else {}), **_generator_params(args.param)}
        block_size = args.block_size or (16 if args.tiny else 64)
        trace = generate_agentx_trace(args.sessions, seed=args.seed, block_size=block_size,
                                      **knobs)
        write_trace(trace, args.out)
        print(f"wrote {len(trace.requests)} requests in {args.sessions} sessions to {args.out}")
        return 0
    stats = trace_stats(load_trace(args.file, format=args.format))
    if args.json:
        print(json.dumps(stats, default=_plain))
    else:
        width = max(len(k) for k in stats)
        for key, value in stats.items():
            print(f"{key:<{width}}  {_fmt(value)}")
    return 0


def _generator_params(pairs: list[str]) -> dict:
    from dataclasses import fields

    from labkit.traces import AgentXParams

    known = {f.name: f.type for f in fields(AgentXParams)}
    params = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or name not in known:
            raise ConfigError(f"--param {pair!r}: expected NAME=VALUE with NAME one of "
                              f"{', '.join(known)}")
        kind = known[name] if not isinstance(known[name], str) else eval(known[name])
        try:
            params[name] = kind(value)
        except ValueError:
            raise ConfigError(f"--param {pair!r}: {value!r} is not a {kind.__name__}") from None
    return params


def _replay(args) -> int:
    from labkit.engine import Engine
    from labkit.traces import load_trace

    if args.concurrency is not None and args.duration_s is None and args.loop_trace:
        raise ConfigError("--concurrency needs --duration-s (or --no-loop-trace)")
    trace = load_trace(args.trace, format=args.format)
    compute = {k: getattr(args, k) for k in ("device", "clock", "dtype", "checkpoint")
               if getattr(args, k) is not None}
    engine = Engine(model=args.model, layout=args.layout, hardware=args.hardware,
                    backend=args.backend, cost_model=args.cost_model, **compute,
                    **knobs_from_args(args))
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    result = engine.replay(trace, concurrency=args.concurrency, duration_s=args.duration_s,
                           open_loop=args.open_loop, warmup_s=args.warmup_s,
                           max_idle_s=args.max_idle_s, start_part_way=args.start_part_way,
                           loop_trace=args.loop_trace, progress=progress)
    if args.out:
        result.save(args.out)
    if args.json:
        print(json.dumps(result.summary, default=_plain))
    else:
        print(format_summary(result.summary))
    return 0


def _capacity(args) -> int:
    from labkit.engine.capacity import capacity

    layouts = [s for s in args.layout.split(",") if s.strip()]
    reports = [capacity(args.model, layout, args.hardware, args.context,
                        kv_dtype=args.kv_dtype, gpu_memory_utilization=args.gpu_memory_utilization,
                        num_speculative_tokens=args.num_speculative_tokens)
               for layout in layouts]
    if args.json:
        print(json.dumps(reports[0] if len(reports) == 1 else reports, default=_plain))
        return 0
    gib = 1 << 30
    print(f"{args.model} on {args.hardware}, one request of {args.context:,} tokens "
          f"(KV {args.kv_dtype})")
    header = (f"{'layout':<16}{'gpus':>5}{'weights/GPU':>13}{'KV copies':>10}"
              f"{'KV/GPU':>10}{'temp/GPU':>10}{'tokens/GPU':>13}{'requests':>10}  fits")
    print(header)
    for r in reports:
        print(f"{r['layout']:<16}{r['gpus']:>5}{r['weights_bytes_per_gpu'] / gib:>10.1f} GiB"
              f"{r['kv_replication']:>10.2f}{r['persistent_kv_bytes_per_gpu'] / gib:>6.2f} GiB"
              f"{r['temporary_kv_bytes_per_gpu'] / gib:>6.2f} GiB"
              f"{r['kv_capacity_tokens_per_gpu']:>13,}{r['max_concurrent_requests']:>10}"
              f"  {r['fits']}")
    return 0


def format_summary(summary: dict) -> str:
    keys = ["model", "layout", "hardware", "gpus", "requests_completed", "sim_duration_s",
            "wall_s", "ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "itl_p50_s", "e2el_p50_s",
            "interactivity_p90_tok_s", "throughput_tok_s_per_gpu", "output_tok_s_per_gpu",
            "tpgs", "prefix_cache_hit_rate", "kv_cache_usage_peak", "preemptions"]
    if summary.get("kv_offload_loaded_tokens"):  # offload tiers: their hits
        keys += ["prefix_cache_local_hit_rate", "kv_offload_loaded_tokens"] + \
            [k for k in summary if k.endswith(("_tier_hit_blocks", "_tier_evicted_blocks"))]
    width = max(len(k) for k in keys)
    return "\n".join(f"{k:<{width}}  {_fmt(summary.get(k))}" for k in keys)


def _fmt(value) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return str(value)


def _plain(value):
    if hasattr(value, "item"):
        return value.item()
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
