"""`labkit sweep`: the command-line face of `labkit.experiments.sweep`.

    labkit sweep NOTEBOOK -p NAME V1,V2 [-p NAME2 V1,V2 ...] --out DIR [--jobs J]
                 [--executor local|ray [--ray-address ADDR]] [--overwrite | --resume]
                 [--timeout S] [--progress | --no-progress]

`add_sweep_arguments(parser)` fills the subcommand's parser (labkit/cli.py creates
it, with its help) and `run_sweep_command(args)` runs it. Exit status: 0 when every run
succeeded, 1 when some failed (how many is printed), 2 on bad input — nothing is run or
written then.
"""

from __future__ import annotations

import argparse
import sys

from labkit.errors import ConfigError

DESCRIPTION = """\
Run an experiment notebook over a grid of parameters with papermill.

The grid is the cartesian product of the -p lists. Each point runs in its own process
(--jobs at a time) with output_dir=DIR/<run> injected; its executed notebook is kept at
DIR/<run>/notebook.ipynb. DIR/results.parquet gets one row per run: the swept
parameters, run, status, error, run_s, then the run's summary.json flattened (a
summary key that is also a swept parameter is written as summary.<key>).
--executor ray runs each point as a Ray task: on the cluster at --ray-address, else on
a local Ray cluster of --jobs CPUs (pip install 'labkit[ray]'). --resume keeps the
points DIR already holds complete (same notebook, same grid) and runs the others.
Values are typed like papermill's -p: True/False, None, ints, floats, else strings
(quote one to keep it a string: -p name '"8"'). Relative paths in values resolve
against the current directory.
"""

EPILOG = """\
example:
  labkit sweep notebooks/experiments/agentx_replay.ipynb \\
      -p layout tp8,dep8 -p concurrency 8,16,32 -p model deepseek-v3 --out runs/grid --jobs 4

exit status: 0 all runs succeeded, 1 some failed, 2 bad input (nothing run or written)
"""


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    """Fill the `sweep` subparser: its description, arguments and `run_command`."""
    parser.description, parser.epilog = DESCRIPTION, EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("notebook", help="the notebook; its cell tagged 'parameters' must "
                                         "define every -p name and output_dir")
    parser.add_argument("-p", "--parameter", dest="sweep_parameters", nargs=2, action="append",
                        metavar=("NAME", "VALUES"), default=[],
                        help="a parameter and its comma-separated values (repeatable)")
    parser.add_argument("--out", dest="sweep_out", required=True, metavar="DIR",
                        help="where runs and results.parquet go (new or empty)")
    parser.add_argument("--jobs", "-j", dest="sweep_jobs", type=int, default=1, metavar="J",
                        help="runs at once, each in its own process (default: 1)")
    parser.add_argument("--executor", dest="sweep_executor", default="local",
                        metavar="local|ray", help="where points run: local processes "
                        "(default) or Ray tasks")
    parser.add_argument("--ray-address", dest="sweep_ray_address", metavar="ADDR",
                        help="a running Ray cluster (ray.init(address=...)); default: a "
                             "local one of --jobs CPUs")
    parser.add_argument("--overwrite", dest="sweep_overwrite", action="store_true",
                        help="allow a DIR that already holds files; replaces this grid's runs")
    parser.add_argument("--resume", dest="sweep_resume", action="store_true",
                        help="keep the points DIR holds complete; run lost or failed ones")
    parser.add_argument("--timeout", dest="sweep_timeout", type=float, default=None,
                        metavar="S", help="fail a run whose cell runs longer than S seconds")
    parser.add_argument("--progress", dest="sweep_progress",
                        action=argparse.BooleanOptionalAction, default=None,
                        help="progress bar over runs (default: on for a terminal)")
    parser.set_defaults(run_command=run_sweep_command)


def run_sweep_command(args) -> int:
    from labkit.experiments.sweep import parse_parameter_args, run_sweep

    try:
        if args.sweep_jobs < 1:
            raise ConfigError(f"--jobs {args.sweep_jobs} must be >= 1")
        if args.sweep_timeout is not None and not args.sweep_timeout > 0:
            raise ConfigError(f"--timeout {args.sweep_timeout} must be > 0")
        params = parse_parameter_args(args.sweep_parameters)
        results = run_sweep(args.notebook, params, args.sweep_out, jobs=args.sweep_jobs,
                            progress=args.sweep_progress, overwrite=args.sweep_overwrite,
                            timeout=args.sweep_timeout, executor=args.sweep_executor,
                            ray_address=args.sweep_ray_address, resume=args.sweep_resume)
    except ConfigError as err:
        print(f"labkit sweep: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:  # SweepInterrupted once runs began: what finished
        print(f"labkit sweep: interrupted{'; ' + str(stop) if str(stop) else ''}",
              file=sys.stderr)
        return 130
    failed = int((results["status"] != "ok").sum())
    total = len(results)
    where = f"{args.sweep_out}/results.parquet"
    kept = results.attrs.get("kept", 0)
    kept = f"; {kept} kept as they were, {total - kept} run now" if kept else ""
    if failed:
        names = list(results.loc[results["status"] != "ok", "run"])
        shown = ", ".join(names[:5]) + (f", ... ({len(names) - 5} more)" if failed > 5 else "")
        print(f"labkit sweep: {failed} of {total} runs failed ({shown}{kept}); results in "
              f"{where}", file=sys.stderr)
        return 1
    print(f"{total} run{'s' if total != 1 else ''} ok{kept}; results in {where}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m labkit.experiments.cli sweep ...` (the same as `labkit sweep ...`)."""
    from labkit.cli import add_command

    parser = argparse.ArgumentParser(prog="labkit")
    add_command(parser.add_subparsers(dest="command", required=True), "sweep")
    args = parser.parse_args(argv)
    return args.run_command(args)


if __name__ == "__main__":
    sys.exit(main())
