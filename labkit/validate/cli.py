"""`labkit validate [--data DIR] [--json]`: the simulator against measured serving runs."""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Fill the `validate` subparser (labkit/cli.py creates it, with its help)."""
    p.add_argument("--data", help="the shared data folder (default: ../shared/data, or "
                                  "$LABKIT_SHARED_DATA)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--duration-scale", type=float, default=None,
                   help="replayed seconds per measured second (default 0.1)")
    p.add_argument("--run", action="append", default=None, metavar="ID",
                   help="replay only this run (repeatable)")


def run(args) -> int:
    from labkit.bench import shared_data_dir
    from labkit.validate.report import DEFAULT_SCALE, validate

    data = args.data or shared_data_dir()
    if data is None:
        print("labkit validate: no data folder (pass --data DIR or set LABKIT_SHARED_DATA)",
              file=sys.stderr)
        return 2
    scale = DEFAULT_SCALE if args.duration_scale is None else args.duration_scale
    if not 0 < scale <= 1:
        print(f"labkit validate: --duration-scale {scale} must be in (0, 1]", file=sys.stderr)
        return 2
    try:
        result = validate(data, scale, args.run, progress=not args.json)
    except (FileNotFoundError, KeyError) as e:
        print(f"labkit validate: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_json(), indent=1))
        return 0
    cols = ["id", "part", "model", "layout", "workload"] + \
        [c for c in result.experiments.columns if c.startswith("ape_")]
    print(result.experiments[cols].to_string(index=False, float_format=lambda x: f"{x:6.1f}"))
    print("\nmedian APE % over runs (fitted part / held-out part):")
    print(result.table().to_string(float_format=lambda x: f"{x:6.1f}"))
    print("\nmean signed error % by model (below 0: simulated faster than measured):")
    print(result.bias().to_string(float_format=lambda x: f"{x:+6.1f}"))
    print("(tail_runs: runs whose measured TTFT mean lies above its p90 in a load stage, a "
          "startup tail no steady state has: read their TTFT p90)")
    stages = result.stage_bias()
    if not stages.empty:
        print("\nthe same by load stage, runs of two stages (stage 0 the lower rate, req/s): "
              "how the error moves with the batch")
        print(stages.to_string(float_format=lambda x: f"{x:+6.1f}",
                               formatters={"rate": lambda x: f"{x:4.0f}"}))
    print(f"\n{len(result.skipped)} measured runs not replayed (see --json 'skipped')")
    return 0


def main(argv=None) -> int:
    from labkit.cli import add_command

    parser = argparse.ArgumentParser(prog="labkit")
    add_command(parser.add_subparsers(dest="command", required=True), "validate")
    return run(parser.parse_args(argv))
