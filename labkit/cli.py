"""`labkit ...`: the command line.

    labkit trace gen --kind agentx --sessions N --seed S [--tiny] --out FILE.jsonl
    labkit trace gen --kind random|shared-prefix|multi-turn [--num-prompts N --request-rate R
                     --burstiness B --input-len L --output-len L --range-ratio r ...] --out F
    labkit trace stats FILE [--format auto|labkit|mooncake|bailian|azure|agentx|...] [--json]
    labkit trace convert IN OUT [--format ...]   (any format -> labkit JSONL)
    labkit replay --trace FILE --model M --layout L --hardware H [knobs...] [--out DIR] [--json]
                  [--timeline FILE.json]
                  [--backend sim|compute [--device cpu|cuda] [--clock measured|predicted]
                   [--executor threads|mp]]   (mp: also under torchrun, see docs/executors.md)
                 [--slo ttft=2,tpot=0.05] [--percentiles 50,90,99] [--gpu-hour-usd X]
                 [--on-oversize error|skip]
    labkit capacity --model M --layout L --hardware H --context N [--json]
    labkit sweep NOTEBOOK -p NAME V1,V2 [-p ...] --out DIR [--jobs J]
    labkit pd profile | sweep ...   (prefill/decode rate matching: see experiments/pd_cli.py)
    labkit plan --trace F --model M --gpus N --slo ttft=2,tpot=0.05 ...   (the deployment
                planner: see experiments/plan_cli.py)
    labkit validate [--data DIR] [--json]   (measured serving runs: see labkit/validate)
    labkit bench sim | costmodel | layouts | kernels | compute | kv | traces
    labkit lab [jupyter lab options]   (what `make lab` runs: see lab.py)

Every `EngineConfig` knob is a `replay` flag (``--max-num-batched-tokens``, ...), built
from the dataclass so the two never drift apart. Mistakes (a malformed trace, an
unknown preset, a knob out of range, a request that can never fit) are reported on
stderr before anything runs, with exit code 2, and nothing is written.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import select
import sys
import types
import typing

from labkit import checks
from labkit.errors import ConfigError
from labkit.traces.load_cli import add_load_flags, generator_params
from labkit.traces.parts import add_trace_flags, load_selected, selection_from_args
from labkit.traces.loads import LOAD_KINDS
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


class OneLineParser(argparse.ArgumentParser):
    """argparse, with its errors (a flag's value of the wrong type, a missing flag) in
    one line like every other labkit error, instead of after the whole usage text."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="labkit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    trace = sub.add_parser("trace", help="generate traces and describe them")
    tsub = trace.add_subparsers(dest="trace_command", required=True)
    gen = tsub.add_parser("gen", help="generate a synthetic trace")
    gen.add_argument("--kind", choices=["agentx", *LOAD_KINDS], default="agentx")
    gen.add_argument("--sessions", type=int, help="sessions (agentx: required; multi-turn)")
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
    add_load_flags(gen)
    stats = tsub.add_parser("stats", help="statistics of a trace")
    stats.add_argument("file")
    stats.add_argument("--json", action="store_true")
    add_trace_flags(stats)
    convert = tsub.add_parser("convert", help="rewrite a trace in any format as labkit JSONL")
    convert.add_argument("input")
    convert.add_argument("output", help="labkit JSONL (.gz: compressed)")
    add_trace_flags(convert)

    replay = sub.add_parser("replay", help="replay a trace against a simulated deployment")
    replay.add_argument("--trace", required=True)
    add_trace_flags(replay)
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
    replay.add_argument("--executor", choices=["threads", "mp"],
                        help="compute backend: GPU ranks as threads of this process "
                             "(default) or as processes over torch.distributed (also under "
                             "torchrun: RANK 0 drives, the others serve)")
    replay.add_argument("--cost-model", default="calibrated", choices=["calibrated", "roofline"],
                        help="step times: kernels fitted on measured H100 latencies "
                             "(default), or a first-order roofline")
    loop = replay.add_mutually_exclusive_group(required=True)
    loop.add_argument("--concurrency", type=int, help="closed loop: sessions in flight")
    loop.add_argument("--open-loop", action="store_true", help="arrive at trace timestamps")
    replay.add_argument("--duration-s", type=float,
                        help="simulated seconds to run (a trace that runs out sooner ends the "
                             "run, and the summary's window, where it ran out)")
    replay.add_argument("--warmup-s", type=float, default=0.0,
                        help="exclude calls arriving before this from the summary")
    replay.add_argument("--max-idle-s", type=float, help="cap on tool gaps (closed loop)")
    replay.add_argument("--start-part-way", action=argparse.BooleanOptionalAction,
                        default=False, help="start the first sessions at a random turn, as "
                        "AgentX does; their first calls then prefill whole contexts cold, so "
                        "pair it with --warmup-s (default: off, sessions start at turn one)")
    replay.add_argument("--loop-trace", action=argparse.BooleanOptionalAction, default=True,
                        help="closed loop: start over with fresh ids when sessions run out")
    replay.add_argument("--on-oversize", choices=["error", "skip"], default="error",
                        help="a request that can never run: refuse the replay (default) "
                             "or skip it and its session's later calls, as vLLM rejects it")
    replay.add_argument("--slo", help="goodput SLOs in seconds, e.g. ttft=2,tpot=0.05,e2el=60")
    replay.add_argument("--percentiles", help="extra percentiles, e.g. 50,90,99")
    replay.add_argument("--gpu-hour-usd", type=float, help="price of a GPU-hour: cost per "
                                                            "million tokens in the summary")
    replay.add_argument("--out", help="write requests.parquet, steps.parquet, summary.json "
                                      "into this folder (all three or none)")
    replay.add_argument("--overwrite", action="store_true",
                        help="replace the results an --out folder already holds")
    replay.add_argument("--timeline", metavar="FILE",
                        help="write the run as Chrome / Perfetto trace-event JSON (.json or "
                             ".json.gz; open it in ui.perfetto.dev)")
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
    from labkit.experiments.plan_cli import add_plan_parser

    add_plan_parser(sub)
    from labkit.validate.cli import add_parser as add_validate_parser

    add_validate_parser(sub)

    # `labkit lab ...` hands every option to jupyter lab (main() routes it before parsing)
    sub.add_parser("lab", help="JupyterLab on this folder: notebooks/ first, runs/ reachable, "
                               "tracked notebooks unchanged by looking (options go to "
                               "jupyter lab)")

    bench = sub.add_parser("bench", help="benchmarks that print figures")
    bench.add_argument("target", choices=["sim", "costmodel", "layouts", "kernels", "compute",
                                          "kv", "traces"])
    bench.add_argument("--quick", action="store_true", help="smaller runs")
    bench.add_argument("--duration-s", type=float, default=None,
                       help="sim: simulated seconds of the replays timed in (b) "
                            "(default 600; 120 with --quick)")
    bench.add_argument("--breakdown", action="store_true",
                       help="sim: only the fast workload of (b), its CPU time split by "
                            "engine component")
    bench.add_argument("--calls", action="store_true",
                       help="sim: only the fast workload of (b), the Python and built-in "
                            "function calls it makes (the same in every run: what a "
                            "change does to the interpreter's work, free of the "
                            "machine's noise)")
    bench.add_argument("--against", metavar="REF", default=None,
                       help="sim: only the fast workload of (b), with this tree and with "
                            "labkit as it was at git revision REF, alternated")
    bench.add_argument("--repeat", type=int, default=None, metavar="N",
                       help="sim: time each replay of (b) N times and keep the least CPU "
                            "time (and the median); with --against, N alternated rounds "
                            "(default 2)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["lab"]:
        from labkit.lab import run_lab

        return run_lab(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        code = _run(args)
        sys.stdout.flush()  # (a reader gone away shows here, not as Python exits)
        return code
    except BrokenPipeError as err:
        if _stdout_gone():  # `labkit ... | head`: stop quietly, as Unix tools do
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 141  # (128 + SIGPIPE: what a shell reports for such a tool)
        print(f"labkit: error: {err}", file=sys.stderr)  # another pipe: a real error
        return 2
    except (ConfigError, TraceError, OSError) as err:
        print(f"labkit: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: nothing half-written was left (labkit.outputs)
        print("labkit: interrupted", file=sys.stderr)
        return 130
    except SystemError as err:  # Ctrl-C inside a compiled (numba) function comes out so
        from labkit.engine.interrupts import interrupted

        if not interrupted(err):
            raise
        print("labkit: interrupted", file=sys.stderr)
        return 130


def _stdout_gone() -> bool:
    """Has the reader of our standard output gone away (a pipe's read end closed)?"""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll, or no real stdout
        return False


def _run(args) -> int:
    """The subcommand's exit status."""
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
    if args.command == "plan":
        from labkit.experiments.plan_cli import run_plan_command

        return run_plan_command(args)
    if args.command == "validate":
        from labkit.validate.cli import run as run_validate

        return run_validate(args)
    if args.command == "bench":
        from labkit.bench import run_bench

        return run_bench(args.target, quick=args.quick, duration_s=args.duration_s,
                         breakdown=args.breakdown, against=args.against,
                         repeat=args.repeat, calls=args.calls)
    return 0


def _trace(args) -> int:
    from labkit.outputs import check_regular_target, strict_json
    from labkit.traces import generate_agentx_trace, trace_stats, write_trace

    if args.trace_command == "convert":
        check_regular_target(args.output, "OUTPUT")  # before reading: a device stays as it is
        trace = load_selected(args.input, args)
        write_trace(trace, args.output)
        print(f"wrote {len(trace.requests)} requests in {len(trace.sessions())} sessions "
              f"({trace.format}, block size {trace.block_size}) to {args.output}")
        return 0
    if args.trace_command == "gen" and args.kind != "agentx":
        from labkit.traces.load_cli import generate_load

        check_regular_target(args.out)
        trace = generate_load(args)
        write_trace(trace, args.out)
        print(f"wrote {len(trace.requests)} requests in {len(trace.sessions())} sessions "
              f"to {args.out}")
        return 0
    if args.trace_command == "gen":
        from labkit.traces.load_cli import given_load_flags

        if given_load_flags(args):
            raise ConfigError(f"{given_load_flags(args)[0]} is not a knob of --kind agentx "
                              f"(use --param NAME=VALUE)")
        if args.sessions is None or args.sessions < 1:
            raise ConfigError(f"--kind agentx needs --sessions N >= 1, got {args.sessions}")
        check_regular_target(args.out)  # before any work: a device or FIFO stays as it is
        from labkit.traces import TINY_AGENTX

        knobs = {**(TINY_AGENTX if args.tiny else {}), **generator_params(args.param)}
        block_size = args.block_size if args.block_size is not None else \
            16 if args.tiny else 64
        checks.integer("--block-size", block_size, low=1)
        trace = generate_agentx_trace(args.sessions, seed=args.seed, block_size=block_size,
                                      **knobs)
        write_trace(trace, args.out)
        print(f"wrote {len(trace.requests)} requests in {args.sessions} sessions to {args.out}")
        return 0
    stats = trace_stats(load_selected(args.file, args))
    if args.json:
        print(strict_json(stats, default=_plain))
    else:
        width = max(len(k) for k in stats)
        for key, value in stats.items():
            print(f"{key:<{width}}  {_fmt(value)}")
    return 0


def _replay(args) -> int:
    from labkit.engine import Engine
    from labkit.engine.replay import check_replay_args
    from labkit.outputs import OutDir, strict_json

    if _torchrun_worker(args):  # a worker process of a torchrun launch: serve the driver
        from labkit.engine.compute.mp_executor import serve

        serve()
        return 0
    if args.concurrency is not None and args.duration_s is None and args.loop_trace:
        raise ConfigError("--concurrency needs --duration-s (or --no-loop-trace)")
    from labkit.engine.slo import metric_options

    metric_options(args.slo, args.percentiles, args.gpu_hour_usd)  # bad values: before loading
    selection_from_args(args)
    with contextlib.ExitStack() as stack:
        # the results folder is claimed (checked, locked) before anything runs
        out = stack.enter_context(OutDir(args.out, args.overwrite)) if args.out else None
        trace = load_selected(args.trace, args)
        compute = {k: getattr(args, k) for k in ("device", "clock", "dtype", "checkpoint",
                                                 "executor")
                   if getattr(args, k) is not None}
        engine = Engine(model=args.model, layout=args.layout, hardware=args.hardware,
                        backend=args.backend, cost_model=args.cost_model, **compute,
                        **knobs_from_args(args))
        stack.enter_context(engine)  # (closed on the way out: worker processes stop)
        check_replay_args(engine, args.concurrency, args.duration_s, args.open_loop,
                          args.warmup_s, args.max_idle_s, spell=checks.flag)
        progress = sys.stderr.isatty() if args.progress is None else args.progress
        timeline = None
        if args.timeline:
            from labkit.exporters import TimelineRecorder

            timeline = TimelineRecorder(engine)
        result = engine.replay(trace, concurrency=args.concurrency, duration_s=args.duration_s,
                               open_loop=args.open_loop, warmup_s=args.warmup_s,
                               max_idle_s=args.max_idle_s, start_part_way=args.start_part_way,
                               loop_trace=args.loop_trace, progress=progress,
                               on_oversize=args.on_oversize, slo=args.slo,
                               percentiles=args.percentiles, gpu_hour_usd=args.gpu_hour_usd)
        if out is not None:
            out.write(result.write_files)
        if timeline is not None:
            timeline.save(args.timeline)
    if args.json:
        print(strict_json(result.summary, default=_plain))
    else:
        from labkit.engine.slo import metric_options, percentile_key

        chosen = metric_options(percentiles=args.percentiles).percentiles
        print(format_summary(result.summary, [
            percentile_key(m, q) for q in chosen
            for m in ("ttft", "tpot", "itl", "e2el", "session_completion")]))
    if result.summary.get("warnings"):  # on stderr: --json output stays one JSON object
        from labkit.engine.run_health import format_warnings

        print(format_warnings(result.summary["warnings"]), file=sys.stderr)
    return 0


def _torchrun_worker(args) -> bool:
    return (args.backend == "compute" and args.executor == "mp"
            and os.environ.get("RANK", "0") != "0" and "WORLD_SIZE" in os.environ)


def _capacity(args) -> int:
    from labkit.outputs import strict_json
    from labkit.engine.capacity import capacity

    layouts = [s for s in args.layout.split(",") if s.strip()]
    reports = [capacity(args.model, layout, args.hardware, args.context,
                        kv_dtype=args.kv_dtype, gpu_memory_utilization=args.gpu_memory_utilization,
                        num_speculative_tokens=args.num_speculative_tokens)
               for layout in layouts]
    if args.json:
        print(strict_json(reports[0] if len(reports) == 1 else reports, default=_plain))
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


def format_summary(summary: dict, extra_keys=()) -> str:
    keys = ["model", "layout", "hardware", "gpus", "requests_completed", "sim_duration_s",
            "wall_s", "ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "itl_p50_s", "e2el_p50_s",
            "interactivity_p90_tok_s", "throughput_tok_s_per_gpu", "output_tok_s_per_gpu",
            "tpgs", "prefix_cache_hit_rate", "kv_cache_usage_peak", "preemptions"]
    keys += ["sessions_completed", "session_completion_p50_s"]
    keys += [k for k in ("requests_skipped", "goodput_req_s", "slo_attainment", "cost_usd",
                         "usd_per_m_tokens") if summary.get(k) is not None
             and (k != "requests_skipped" or summary[k])]
    keys += [k for k in extra_keys if k not in keys]
    if summary.get("kv_offload_loaded_tokens"):  # offload tiers: their hits
        keys += ["prefix_cache_local_hit_rate", "kv_offload_loaded_tokens"] + \
            [k for k in summary if k.endswith(("_tier_hit_blocks", "_tier_evicted_blocks"))]
    # a disk tier that degraded (damaged blocks recomputed, writes that failed)
    keys += [k for k in summary if k.endswith(("_tier_corrupt_blocks",
                                               "_tier_unwritable_blocks")) and summary[k]]
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
