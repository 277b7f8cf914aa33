"""`labkit plan`: the command-line face of the deployment planner (`plan.py`).

    labkit plan --trace FILE --model M --hardware H --gpus N --slo ttft=2,tpot=0.05
                [--format F] [--window S:E] [--sample-sessions F] [--speedup R] [--where C]
                [--concurrency 8,32] [--duration-s S] [--warmup-s S] [--layouts L1,L2]
                [--no-pd] [--pd-layouts L1,L2] [--max-groups G] [--max-model-len N]
                [--max-num-batched-tokens 2048,8192] [--long-prefill-token-threshold 0,4096]
                [--min-attainment 0.9] [--gpu-hour-usd X]
                [--executor local|ray] [--ray-address ADDR] [--jobs J] [--top K]
                [--out DIR [--overwrite]]

Prints the best configurations meeting the SLOs and the throughput-per-GPU vs
interactivity frontier; with --out, writes plan.parquet (every point), best.parquet
and frontier.parquet. Exit status: 0 when some configuration meets the SLOs, 1 when
none does, 2 on bad input (nothing run or written).
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import pandas as pd

from labkit.errors import ConfigError
from labkit.traces.parts import add_trace_flags, load_selected, selection_from_args
from labkit.traces.validate import TraceError
from labkit.specs.hardware import HARDWARE_PRESETS

TABLES = ("plan", "best", "frontier")
SHOWN = ["rank", "config", "gpus", "max_num_batched_tokens", "long_prefill_token_threshold",
         "concurrency", "goodput_req_s_per_gpu", "slo_attainment", "throughput_tok_s_per_gpu",
         "interactivity_p90_tok_s", "ttft_p90_s", "tpot_p90_s", "usd_per_m_tokens"]


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """Fill the `plan` subparser (labkit/cli.py creates it, with its help)."""
    p.description = __doc__.split("\n\n")[2]
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--trace", required=True, help="a trace file (any format labkit reads)")
    add_trace_flags(p)
    p.add_argument("--model", required=True)
    p.add_argument("--hardware", default="h200", choices=sorted(HARDWARE_PRESETS))
    p.add_argument("--gpus", type=int, required=True, help="GPUs available (the most a "
                                                            "configuration may use)")
    p.add_argument("--slo", required=True, help="SLOs in seconds, e.g. ttft=2,tpot=0.05")
    p.add_argument("--min-attainment", type=float, default=0.9,
                   help="share of calls that must meet the SLOs (default 0.9)")
    p.add_argument("--gpu-hour-usd", type=float, help="price of a GPU-hour: adds each "
                   "configuration's cost per million tokens (usd_per_m_tokens)")
    p.add_argument("--concurrency", default="8", help="sessions in flight, comma-separated")
    p.add_argument("--duration-s", type=float, default=60.0, help="simulated s per point")
    p.add_argument("--warmup-s", type=float, help="default: a fifth of --duration-s")
    p.add_argument("--layouts", help="only these layouts (default: every legal one)")
    p.add_argument("--pd-layouts", help="layouts the P/D roles may take (default: --layouts)")
    p.add_argument("--max-model-len", type=int, help="the engine knob, for every "
                                                      "configuration (default: the model's)")
    p.add_argument("--pd", action=argparse.BooleanOptionalAction, default=True,
                   help="also try prefill/decode splits (default: on)")
    p.add_argument("--max-groups", type=int, default=2, help="most groups of one P/D role")
    p.add_argument("--max-num-batched-tokens", help="values to try, comma-separated")
    p.add_argument("--long-prefill-token-threshold", help="values to try, comma-separated")
    p.add_argument("--on-oversize", choices=["error", "skip"], default="error",
                   help="a request that can never run fails the point (default) or is skipped")
    p.add_argument("--executor", default="local", metavar="local|ray")
    p.add_argument("--ray-address", metavar="ADDR")
    p.add_argument("--jobs", "-j", type=int, default=1, help="points at once (local) or the "
                                                            "local Ray cluster's CPUs")
    p.add_argument("--top", type=int, default=5, help="best configurations to print")
    p.add_argument("--out", help="write plan.parquet, best.parquet, frontier.parquet here")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)
    p.set_defaults(run_command=run_plan_command)


def run_plan_command(args) -> int:
    from labkit.experiments.plan import plan
    from labkit.outputs import OutDir

    try:
        selection_from_args(args)  # (bad flags: before the folder is claimed)
        with contextlib.ExitStack() as stack:
            out = stack.enter_context(OutDir(args.out, args.overwrite, results=[
                f"{t}.parquet" for t in TABLES])) if args.out else None
            trace = load_selected(args.trace, args)  # a malformed trace: refused here
            # (loaded once: it travels to each worker once, `executors.py`, which also
            # spares a remote Ray cluster reading the file)
            result = plan(trace, args.model,
                          args.hardware, args.gpus, args.slo,
                          concurrency=_ints("--concurrency", args.concurrency),
                          duration_s=args.duration_s, warmup_s=args.warmup_s,
                          layouts=_texts(args.layouts), disaggregated=args.pd,
                          max_num_batched_tokens=_ints("--max-num-batched-tokens",
                                                       args.max_num_batched_tokens),
                          long_prefill_token_threshold=_ints(
                              "--long-prefill-token-threshold",
                              args.long_prefill_token_threshold),
                          max_groups=args.max_groups, pd_layouts=_texts(args.pd_layouts),
                          knobs=({"max_model_len": args.max_model_len}
                                 if args.max_model_len is not None else None),
                          min_attainment=args.min_attainment,
                          executor=args.executor, jobs=args.jobs,
                          ray_address=args.ray_address, progress=args.progress,
                          on_oversize=args.on_oversize, gpu_hour_usd=args.gpu_hour_usd)
            tables = dict(zip(TABLES, (result.results, result.best, result.frontier)))
            if out is not None:
                out.write(lambda folder: [t.to_parquet(folder / f"{name}.parquet", index=False)
                                          for name, t in tables.items()])
    except (ConfigError, TraceError, OSError) as err:
        print(f"labkit plan: error: {err}", file=sys.stderr)
        return 2
    failed = int((result.results["status"] != "ok").sum())
    # the knobs not searched are empty columns: left out of the printed tables
    shown = [c for c in SHOWN if result.results[c].notna().any()]
    with pd.option_context("display.width", 200, "display.max_columns", 30):
        print(f"{len(result.results)} configurations simulated ({failed} refused by the "
              f"engine); {len(result.best)} meet the SLOs ({args.slo}, attainment >= "
              f"{args.min_attainment:g})")
        _print_refusals(result.results, args.on_oversize)
        if len(result.best):
            print("\nbest, by goodput per GPU:")
            print(result.best[shown].head(args.top).to_string(index=False))
        print("\nthroughput per GPU vs interactivity frontier:")
        print(result.frontier[shown].to_string(index=False) if len(result.frontier)
              else "  (empty: no configuration ran)")
    return 0 if len(result.best) else 1


def _print_refusals(results: pd.DataFrame, on_oversize: str = "error",
                    shown: int = 5) -> None:
    """Why points were refused: the commonest reasons, with their counts (and, where a
    call no rank can hold refused points, how to serve the rest of the trace)."""
    reasons = results.loc[results["status"] != "ok", "error"].value_counts()
    for reason, count in reasons.head(shown).items():
        print(f"  refused {count}x: {reason}")
    if len(reasons) > shown:
        print(f"  ... and {len(reasons) - shown} other reasons (plan.parquet's error column)")
    oversize = int(results["oversize"].sum())
    if oversize and on_oversize == "error":
        print(f"  ({oversize} of them for a call no rank can hold: --on-oversize skip "
              f"serves the other calls and counts the skipped ones)")


def _texts(text: str | None) -> list[str] | None:
    return None if text is None else [s.strip() for s in text.split(",") if s.strip()]


def _ints(flag: str, text: str | None) -> tuple:
    if text is None:
        return (None,)
    try:
        return tuple(int(s) for s in _texts(text))
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: give integers separated by commas") from None
