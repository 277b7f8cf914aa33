"""The arguments of `labkit trace`, `replay`, `capacity` and `bench` (labkit/cli.py).

Each `add_*_arguments(parser)` fills a subcommand's parser, which labkit/cli.py has
already created with its help string (`COMMANDS`). They are called only for the
subcommand a command line names, and import what they need (labkit.traces, labkit.specs:
pandas, numba) inside themselves, so `labkit --help` imports none of it.

Every `EngineConfig` knob is a `replay` (and `pd`) flag, built from the dataclass by
`add_knob_flags` so the two never drift apart; `knobs_from_args` reads them back.
"""

from __future__ import annotations

import argparse
import types
import typing

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
    from labkit.specs.config import knob_fields

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
    from labkit.specs.config import knob_fields

    return {name: getattr(args, name) for name, *_ in knob_fields()
            if getattr(args, name) is not None}


def add_trace_arguments(trace: argparse.ArgumentParser) -> None:
    from labkit.traces.load_cli import add_load_flags
    from labkit.traces.loads import LOAD_KINDS
    from labkit.traces.parts import add_trace_flags

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


def add_replay_arguments(replay: argparse.ArgumentParser) -> None:
    # (in this order: it is the order of `labkit replay --help`)
    _add_replay_deployment(replay)
    _add_replay_loop(replay)
    _add_replay_results(replay)
    add_knob_flags(replay)


def _add_replay_deployment(replay: argparse.ArgumentParser) -> None:
    """The trace, and what serves it."""
    from labkit.specs.hardware import HARDWARE_PRESETS
    from labkit.specs.model_presets import MODEL_PRESETS
    from labkit.traces.parts import add_trace_flags

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


def _add_replay_loop(replay: argparse.ArgumentParser) -> None:
    """How calls arrive, and for how long."""
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


def _add_replay_results(replay: argparse.ArgumentParser) -> None:
    """What the run reports, and where it is written."""
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


def add_capacity_arguments(cap: argparse.ArgumentParser) -> None:
    from labkit.specs.hardware import HARDWARE_PRESETS

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


def add_bench_arguments(bench: argparse.ArgumentParser) -> None:
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
