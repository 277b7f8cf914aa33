"""`labkit pd profile | sweep`: the command-line face of `rate_matching.py`.

    labkit pd profile --trace FILE --model M [--prefill-layouts L1,L2] [--decode-layouts L3]
                      [--concurrency 1,2,4,...] [--duration-s S] [--out DIR] [knobs...]
    labkit pd sweep --trace FILE --model M --prefill-layout L --decode-layout L
                    [--ratios 1:2,2:3 | --max-groups N --count K] [--concurrency C]
                    [--duration-s S] [--out DIR] [knobs...]

`profile` prints every point tried and the saturation table (each role and layout's
rate); `sweep` prints one row per P:D candidate. With --out, the tables are written as
parquet (profile.parquet, saturation.parquet, sweep.parquet). Engine knobs apply to
both roles. The trace takes the flags of `labkit replay` that pick a part of it
(--format, --window, --sample-sessions, --speedup, --where). Bad input exits 2 before
anything runs.
"""

from __future__ import annotations

import argparse
import contextlib

import pandas as pd

from labkit import checks
from labkit.errors import ConfigError
from labkit.specs.hardware import HARDWARE_PRESETS
from labkit.traces.parts import add_trace_flags, load_selected, selection_from_args

# what each command writes into --out (other files there are kept)
TABLE_FILES = {"profile": ("profile.parquet", "saturation.parquet"),
               "sweep": ("sweep.parquet",)}


def add_pd_arguments(pd_parser: argparse.ArgumentParser) -> None:
    """Fill the `pd` subparser (labkit/cli.py creates it, with its help)."""
    from labkit.cli_parsers import add_knob_flags

    sub = pd_parser.add_subparsers(dest="pd_command", required=True)
    profile = sub.add_parser("profile", help="phase 1: each role alone, until saturation")
    profile.add_argument("--prefill-layouts", default="",
                         help="comma-separated prefill layouts, e.g. tp8,pcp8xdcp8")
    profile.add_argument("--decode-layouts", default="",
                         help="comma-separated decode layouts, e.g. dep8,tp8xdcp8")
    profile.add_argument("--concurrency", default="1,2,4,8,16,32,64,128",
                         help="concurrency grid, raised until throughput saturates")
    sweep = sub.add_parser("sweep", help="phase 2: the full system at P:D ratios")
    sweep.add_argument("--prefill-layout", required=True)
    sweep.add_argument("--decode-layout", required=True)
    sweep.add_argument("--ratios", help="P:D pairs, e.g. 1:1,1:2,2:3 (default: profile the "
                                        "two layouts and take the pairs nearest the match)")
    sweep.add_argument("--max-groups", type=int, default=4, help="most groups of one role")
    sweep.add_argument("--count", type=int, default=5, help="how many P:D candidates")
    sweep.add_argument("--concurrency", type=int,
                       help="sessions in flight (default: D x the decode saturation point)")
    for p in (profile, sweep):
        p.add_argument("--trace", required=True)
        add_trace_flags(p)
        p.add_argument("--model", required=True)
        p.add_argument("--hardware", default="h200", choices=sorted(HARDWARE_PRESETS))
        p.add_argument("--duration-s", type=float, default=60.0,
                       help="simulated seconds per point")
        p.add_argument("--warmup-s", type=float,
                       help="seconds of each point left out of its figures (default: a "
                            "fifth of --duration-s)")
        p.add_argument("--out", help="write the tables as parquet into this folder (all or "
                                     "none)")
        p.add_argument("--overwrite", action="store_true",
                       help="replace the tables an --out folder already holds")
        p.add_argument("--json", action="store_true", help="print the tables as JSON")
        p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)
        add_knob_flags(p)


def run_pd_command(args, knobs: dict) -> int:
    import sys

    from labkit.outputs import OutDir, strict_json

    selection_from_args(args)  # (bad flags: before the folder is claimed)
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    with contextlib.ExitStack() as stack:
        # the results folder is claimed (checked, locked) before anything runs
        out = stack.enter_context(OutDir(args.out, args.overwrite,
                                         results=TABLE_FILES[args.pd_command])) \
            if args.out else None
        tables = _run(args, knobs, load_selected(args.trace, args), progress)
        if out is not None:
            out.write(lambda folder: _write_tables(tables, folder))
    if args.json:
        print(strict_json({k: t.to_dict(orient="records") for k, t in tables.items()},
                          default=float))
    else:
        with pd.option_context("display.width", 200, "display.max_columns", 30):
            for name, table in tables.items():
                print(f"== {name}")
                print(table.round(4).to_string(index=False))
    return 0


def _run(args, knobs: dict, trace, progress: bool) -> dict[str, pd.DataFrame]:
    from labkit.experiments.rate_matching import check_run_length, pd_profile, pd_sweep, \
        saturation_table

    check_run_length(args.duration_s, args.warmup_s, spell=checks.flag)

    tables: dict[str, pd.DataFrame] = {}
    if args.pd_command == "profile":
        grid = _ints(args.concurrency, "--concurrency")
        prefill, decode = _layouts(args.prefill_layouts), _layouts(args.decode_layouts)
        profile = pd_profile(args.model, trace, prefill, decode, args.hardware,
                             concurrency=grid, duration_s=args.duration_s,
                             progress=progress, warmup_s=args.warmup_s, **knobs)
        tables = {"profile": profile,
                  "saturation": saturation_table(profile).reset_index()}
    else:
        ratios = _ratios(args.ratios) if args.ratios else None
        if args.max_groups < 1 or args.count < 1:
            raise ConfigError("--max-groups and --count must be >= 1")
        tables["sweep"] = pd_sweep(args.model, trace, args.prefill_layout, args.decode_layout,
                                   args.hardware, ratios=ratios, max_groups=args.max_groups,
                                   count=args.count, concurrency=args.concurrency,
                                   duration_s=args.duration_s, progress=progress,
                                   warmup_s=args.warmup_s, **knobs)
    return tables


def _write_tables(tables: dict[str, pd.DataFrame], folder) -> None:
    for name, table in tables.items():
        table.to_parquet(folder / f"{name}.parquet")


def _layouts(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected comma-separated integers") from None
    if not values or min(values) < 1:
        raise ConfigError(f"{flag} {text!r}: expected integers >= 1")
    return sorted(set(values))


def _ratios(text: str) -> list[tuple[int, int]]:
    pairs = []
    for item in text.split(","):
        p, sep, d = item.strip().partition(":")
        if not (sep and p.isdigit() and d.isdigit() and int(p) >= 1 and int(d) >= 1):
            raise ConfigError(f"--ratios {text!r}: expected P:D pairs of integers >= 1, "
                              f"e.g. 1:2,2:3")
        pairs.append((int(p), int(d)))
    return pairs
