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
from the dataclass so the two never drift apart (labkit/cli_parsers.py). Mistakes (a
malformed trace, an unknown preset, a knob out of range, a request that can never fit)
are reported on stderr before anything runs, with exit code 2, and nothing is written.

The parser lists every subcommand (`COMMANDS`) but builds the arguments of only the one
a command line names: their modules pull in pandas and numba, which `labkit --help` and
a mistyped command need none of (they answer in a tenth of a second, not seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import math
import os
import select
import sys
import typing

from labkit import checks
from labkit.errors import ConfigError


class Command(typing.NamedTuple):
    name: str
    help: str
    # "module:function" that adds the subcommand's arguments to its parser; imported only
    # for the subcommand a command line names (the modules pull in pandas and numba)
    builder: str | None


COMMANDS = (  # (in the order `labkit --help` lists them)
    Command("trace", "generate traces and describe them",
            "labkit.cli_parsers:add_trace_arguments"),
    Command("replay", "replay a trace against a simulated deployment",
            "labkit.cli_parsers:add_replay_arguments"),
    Command("capacity", "what a request costs under a layout, how many fit",
            "labkit.cli_parsers:add_capacity_arguments"),
    Command("sweep", "run an experiment notebook over a parameter grid (papermill)",
            "labkit.experiments.cli:add_sweep_arguments"),
    Command("pd", "prefill/decode disaggregation: rate matching (profile, sweep)",
            "labkit.experiments.pd_cli:add_pd_arguments"),
    Command("plan", "search layouts, P/D splits and scheduler knobs for the best "
                    "deployment meeting SLOs (by simulation)",
            "labkit.experiments.plan_cli:add_plan_arguments"),
    Command("validate", "replay the measured serving runs of ../shared/data/e2e and report "
                        "the error", "labkit.validate.cli:add_arguments"),
    # `labkit lab ...` hands every option to jupyter lab (main() routes it before parsing)
    Command("lab", "JupyterLab on this folder: notebooks/ first, runs/ reachable, tracked "
                   "notebooks unchanged by looking (options go to jupyter lab)", None),
    Command("bench", "benchmarks that print figures", "labkit.cli_parsers:add_bench_arguments"),
)


class OneLineParser(argparse.ArgumentParser):
    """argparse, with its errors (a flag's value of the wrong type, a missing flag) in
    one line like every other labkit error, instead of after the whole usage text."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """labkit's parser. Every subcommand is listed, but only the one `argv` names gets
    its arguments (none when it names none: `labkit --help`); without argv, all do."""
    parser = OneLineParser(prog="labkit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    named = None if argv is None else next((a for a in argv if not a.startswith("-")), None)
    for command in COMMANDS:
        add_command(sub, command.name, arguments=argv is None or command.name == named)
    return parser


def add_command(subparsers, name: str, arguments: bool = True) -> argparse.ArgumentParser:
    """Add subcommand `name` of `COMMANDS` to an argparse subparsers object, with its
    help and, if `arguments`, its arguments; returns its parser."""
    command = next(c for c in COMMANDS if c.name == name)
    parser = subparsers.add_parser(name, help=command.help)
    if arguments and command.builder is not None:
        module, function = command.builder.split(":")
        getattr(importlib.import_module(module), function)(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["lab"]:
        from labkit.lab import run_lab

        return run_lab(argv[1:])
    args = build_parser(argv).parse_args(argv)
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
    except (ValueError, OSError) as err:  # (ValueError: ours only, see _user_error)
        if not _user_error(err):
            raise
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


def _user_error(err: Exception) -> bool:
    """One of the mistakes reported in a line with exit code 2: a bad setting, a file
    that cannot be used, a malformed trace (TraceError's module is imported only here:
    labkit.traces is heavy, and most commands never load it)."""
    if isinstance(err, (ConfigError, OSError)):
        return True
    from labkit.traces.validate import TraceError

    return isinstance(err, TraceError)


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
        from labkit.cli_parsers import knobs_from_args
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
    from labkit.traces.parts import load_selected

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
        from labkit.traces.load_cli import generator_params

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
    from labkit.cli_parsers import knobs_from_args
    from labkit.engine import Engine
    from labkit.engine.replay import check_replay_args
    from labkit.outputs import OutDir, strict_json
    from labkit.traces.parts import load_selected, selection_from_args

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
