"""Helpers for the experiment tests: where the notebooks are, a tiny notebook fixture,
and running `labkit sweep` in-process."""

from __future__ import annotations

import argparse
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from labkit.cli import add_command

REPO = Path(__file__).resolve().parents[2]
EXPERIMENTS = REPO / "notebooks" / "experiments"
AGENTX_REPLAY = EXPERIMENTS / "agentx_replay.ipynb"
COMPARE = EXPERIMENTS / "compare.ipynb"
TRACE_REPLAY = EXPERIMENTS / "trace_replay.ipynb"


def sweep(argv: list[str]) -> int:
    """`labkit sweep ARGV...` as labkit/cli.py wires it (a `sweep` subparser)."""
    parser = argparse.ArgumentParser(prog="labkit")
    sub = parser.add_subparsers(dest="command", required=True)
    add_command(sub, "sweep")
    args = parser.parse_args(["sweep", *map(str, argv)])
    return args.run_command(args)


TINY_SOURCE = '''
import json, os, sys
if x == 3:
    raise ValueError("x=3 is impossible")
if x != 2:  # x == 2 "forgets" to write its summary
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "summary.json"), "w") as f:
        json.dump({"x": x, "double": 2 * x, "label": label, "executable": sys.executable,
                   "cwd": os.getcwd(), "nested": {"a": x, "b": [1, 2]}}, f)
print("done", x)
'''


def tiny_notebook(path: Path, parameters: str = 'x = 1\nlabel = "a"\noutput_dir = None',
                  tagged: bool = True) -> Path:
    """A notebook that runs in a kernel start's time: writes summary.json from its
    parameters; x == 3 raises, x == 2 writes no summary."""
    params = new_code_cell(parameters)
    if tagged:
        params.metadata["tags"] = ["parameters"]
    nb = new_notebook(cells=[new_markdown_cell("# tiny"), params,
                             new_code_cell(TINY_SOURCE.strip())])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, path)
    return path


def tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else []
