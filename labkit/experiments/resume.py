"""Resuming a sweep: which points are already done, and whether OUT is this sweep.

A sweep killed half-way (or one whose points partly failed) leaves OUT with some
finished run folders. ``--resume`` runs the grid again into the same OUT but keeps
every point that is *complete* untouched — not re-run, not rewritten — and runs the
others (never started, lost, failed) from a clean folder.

**Complete** means the run folder holds ``run.json`` — written by the sweep, after
the point succeeded, as the last thing it does for that point — whose parameters
are exactly the point's (values and types: ``1``, ``1.0`` and ``True`` differ), and
its ``summary.json`` is still there. A folder without the marker may be a run that
was killed mid-way; it is run again.

**This sweep** means OUT's ``sweep.json`` names the same notebook and the same grid
(the same parameters, each with the same values in the same order, so run names and
their points agree). Anything else is refused, naming the first difference, before
anything runs: resuming into another grid would mix two experiments in one table.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from labkit.errors import ConfigError

MARKER = "run.json"


def mark_complete(run_dir: Path, point: dict, seconds: float) -> None:
    """Record (atomically) that this point finished ok, with its parameters."""
    tmp = run_dir / f".{MARKER}.tmp"
    tmp.write_text(json.dumps({"parameters": point, "run_s": seconds}, default=str) + "\n")
    os.replace(tmp, run_dir / MARKER)


def completed_seconds(run_dir: Path, point: dict, summary_file: str) -> float | None:
    """The run's wall seconds if the folder holds this point's complete run, else None."""
    try:
        marker = json.loads((run_dir / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not (run_dir / summary_file).is_file():
        return None
    if _key(marker.get("parameters")) != _key(point):
        return None
    return float(marker.get("run_s", float("nan")))


def _key(point) -> str:
    return json.dumps(point, sort_keys=True, default=str)


def check_resumable(out: Path, previous: dict | None, notebook: Path,
                    parameters: dict[str, list]) -> None:
    """Refuse (ConfigError) to resume into an OUT that holds another sweep."""
    if previous is None:
        if out.is_dir() and any(out.iterdir()):
            raise ConfigError(f"--resume: {out} holds files but no sweep.json; it is not a "
                              "sweep's output folder")
        return
    if Path(previous["notebook"]) != Path(notebook):
        raise ConfigError(f"--resume: {out} is a sweep of {previous['notebook']}, "
                          f"not of {notebook}")
    before = previous["parameters"]
    for name in before:
        if name not in parameters:
            raise ConfigError(f"--resume: {out} swept -p {name} {_values(before[name])}; "
                              "this grid does not")
    for name, values in parameters.items():
        if name not in before:
            raise ConfigError(f"--resume: this grid sweeps -p {name}, {out} did not")
        if _key(list(values)) != _key(before[name]):
            raise ConfigError(f"--resume: -p {name} was {_values(before[name])} in {out}, "
                              f"here {_values(values)}")
    if list(before) != list(parameters):
        raise ConfigError(f"--resume: the parameters were given in the order "
                          f"{', '.join(before)} in {out}, here {', '.join(parameters)}")


def _values(values: list) -> str:
    return ",".join(json.dumps(v) if isinstance(v, str) else str(v) for v in values)
