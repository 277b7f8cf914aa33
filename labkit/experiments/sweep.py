"""Parameter sweeps over an experiment notebook, run with papermill.

A sweep is the cartesian product of lists of parameter values. Every point runs the
notebook once with papermill, in a worker of the chosen executor (`executors.py`:
local processes, `jobs` at a time, or Ray tasks), with ``output_dir = OUT/<run name>``
injected next to the point's parameters; the executed notebook is kept at
``OUT/<run name>/notebook.ipynb``, and a point that succeeded gets ``run.json`` (its
parameters and seconds), which lets ``resume`` keep it (`resume.py`). A failing point is reported
(on stderr and in the results) and the others go on. At the end ``OUT/results.parquet``
holds one row per run, written atomically.

**Run names** are deterministic and readable: the point's index in the grid (zero
padded, so names sort in grid order), then ``name=value`` for every parameter that
takes more than one value in the sweep, in the order the parameters were given, joined
by commas — e.g. ``03_layout=tp2,concurrency=8``. Values are sanitised for file names
(anything outside ``[A-Za-z0-9._+-]`` becomes ``_``) and the name is cut at 120
characters; the index keeps names unique whatever the sanitising does. A sweep in which
no parameter varies has runs named by their index alone (``00``).

**results.parquet** columns, in this order:

- one column per swept parameter (those given with ``-p``, single values included),
  holding the value the run was given; a column whose values mix types (``None`` aside)
  is stored as text;
- ``run`` (its directory name under OUT), ``status`` (``"ok"`` or ``"failed"``),
  ``error`` (``None``, or ``"ExceptionName: message"`` for a failed run), ``run_s``
  (wall seconds the run took, kernel start included);
- the run's ``summary.json``, flattened (nested keys joined with ``.``): each key
  keeps its own name (``throughput_tok_s_per_gpu``, ``interactivity_p90_tok_s``, ...)
  unless that name is already a column above — a swept parameter such as
  ``concurrency`` or ``layout`` — in which case it is written as ``summary.<key>``.
  A failed run has nulls there. A run whose notebook finished without writing
  ``summary.json`` into its ``output_dir`` counts as failed.

``OUT/sweep.json`` (written before the first run) records the notebook, the swept
parameters and their values, and the run names.

Bad input — a notebook that does not exist or has no cell tagged ``parameters``, a
parameter that cell does not define, an ``output_dir`` the cell lacks, a malformed or
repeated value list, an OUT directory that already holds files (without
``overwrite`` or ``resume``), a ``resume`` into another sweep's OUT, an unknown
executor — raises `SweepInputError` before anything runs or is written.
"""

from __future__ import annotations

import ast
import itertools
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from labkit.errors import ConfigError
from labkit.experiments.executors import check_executor, run_tasks
from labkit.experiments.resume import check_resumable, completed_seconds, mark_complete
from labkit.experiments.sweep_results import (  # noqa: F401 - flatten: part of the API
    PLAN_FILE, RESERVED_COLUMNS, RESULTS_FILE, SUMMARY_FILE, collect_results, flatten, load_plan,
    swept_parameters, text, write_parquet_atomic)

OUTPUT_PARAMETER = "output_dir"
RUN_NOTEBOOK = "notebook.ipynb"
MAX_NAME_CHARS = 120
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]")


class SweepInputError(ConfigError):
    """A sweep that cannot start: the message names the problem."""


# --------------------------------------------------------------------------- values
def parse_value(text: str):
    """One ``-p`` value, typed as papermill types them: ``True``/``False``, ``None``,
    ints, floats, else the string itself. YAML spellings ``true``, ``false``, ``null``,
    ``none`` and ``~`` are accepted too. A value in quotes (``'8'``, ``"a,b"``) is a
    string, as written."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    word = text.strip()
    if word in ("True", "true"):
        return True
    if word in ("False", "false"):
        return False
    if word in ("None", "none", "null", "~"):
        return None
    try:
        return int(word)
    except ValueError:
        pass
    try:
        return float(word)
    except ValueError:
        return text


def parse_values(name: str, text: str) -> list:
    """``"tp1,tp2"`` -> ``["tp1", "tp2"]``; commas inside quotes do not split."""
    parts, current, quote = [], [], None
    for ch in text:
        if quote:
            current.append(ch)
            if ch == quote:
                quote = None
        elif ch in "'\"" and not "".join(current).strip():
            quote = ch
            current = [ch]
        elif ch == ",":
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if quote:
        raise SweepInputError(f"-p {name} {text!r}: unbalanced quote")
    parts.append("".join(current))
    if any(not p.strip() for p in parts):
        raise SweepInputError(f"-p {name} {text!r}: empty value (values are separated by "
                              "single commas; quote a value that contains one)")
    return [parse_value(p.strip()) for p in parts]


def parse_parameter_args(pairs) -> dict[str, list]:
    """[("layout", "tp1,tp2"), ...] from ``-p`` -> {"layout": ["tp1", "tp2"], ...}."""
    params: dict[str, list] = {}
    for name, values in pairs or []:
        if name in params:
            raise SweepInputError(f"-p {name} is given twice; list all its values once, "
                                  "separated by commas")
        params[name] = parse_values(name, values)
    return params


# ----------------------------------------------------------------------------- plan
@dataclass
class SweepPlan:
    notebook: Path
    out: Path
    parameters: dict[str, list]          # swept name -> values, in the order given
    points: list[dict] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    cwd: Path = field(default_factory=Path.cwd)

    def to_json(self) -> dict:
        return {"notebook": str(self.notebook), "out": str(self.out), "cwd": str(self.cwd),
                "parameters": self.parameters, "runs": self.names,
                "points": [dict(p) for p in self.points]}


def notebook_parameters(notebook: str | os.PathLike) -> dict[str, dict]:
    """Parameters defined by the notebook's (first) cell tagged ``parameters``: name ->
    {name, inferred_type_name, default, help}, as papermill's inspection gives them --
    but read by Python's own parser: papermill's skips a line holding two ``=``, such
    as ``slo = "ttft=2,tpot=0.05"``, and a sweep then refused ``-p slo``."""
    import nbformat

    path = Path(notebook)
    if not path.is_file():
        raise SweepInputError(f"notebook {str(notebook)!r} not found")
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as err:  # nbformat raises several kinds
        raise SweepInputError(f"{notebook}: not a readable notebook ({err})") from None
    cell = next((cell for cell in nb.cells
                 if "parameters" in cell.get("metadata", {}).get("tags", [])), None)
    if cell is None:
        raise SweepInputError(f"{notebook}: no cell is tagged 'parameters'")
    try:
        tree = ast.parse(cell.source)
    except SyntaxError as err:
        raise SweepInputError(f"{notebook}: its parameters cell is not Python "
                              f"(line {err.lineno}: {err.msg})") from None
    lines = cell.source.splitlines()
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, annotation = node.targets[0], None
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, annotation = node.target, node.annotation
        else:
            continue
        if isinstance(target, ast.Name):
            rest = lines[node.end_lineno - 1][node.end_col_offset:]
            found[target.id] = {
                "name": target.id, "default": ast.get_source_segment(cell.source, node.value),
                "inferred_type_name": ast.unparse(annotation) if annotation else "None",
                "help": rest.split("#", 1)[1].strip() if "#" in rest else ""}
    return found


def check_value_types(name: str, values: list, parameter: dict) -> None:
    """Each value must have the type of the notebook's default for it (an int knob gets
    ints, not 'abc', 1.5 or True; a float knob finite numbers); a default of None, or
    one that is not a literal, takes anything."""
    kind = _default_type(parameter)
    for value in values:
        if kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) \
                and math.isfinite(value)
        else:
            ok = kind is None or isinstance(value, kind)
        if not ok:
            raise SweepInputError(
                f"-p {name} {value!r}: the notebook's {name} is {_A[kind]} (default "
                f"{parameter['default']}); give {_A[kind].split(' ', 1)[1]}s, "
                f"or quote a value to make it a string")


_A = {int: "an int", float: "a float", str: "a str", bool: "a bool"}


def _default_type(parameter: dict):
    """int, float, str or bool, from the parameter's annotation or default; None when
    either says nothing definite."""
    named = {"int": int, "float": float, "str": str, "bool": bool}
    if parameter.get("inferred_type_name") in named:
        return named[parameter["inferred_type_name"]]
    try:
        default = ast.literal_eval(str(parameter.get("default")))
    except (ValueError, SyntaxError):
        return None
    return type(default) if type(default) in _A else None


def run_name(index: int, count: int, point: dict, varying: list[str]) -> str:
    width = max(2, len(str(max(count - 1, 0))))
    parts = [f"{name}={_UNSAFE.sub('_', text(point[name]))}" for name in varying]
    name = f"{index:0{width}d}" + ("_" + ",".join(parts) if parts else "")
    return name[:MAX_NAME_CHARS]


def plan_sweep(notebook: str | os.PathLike, parameters: dict[str, list],
               out: str | os.PathLike, overwrite: bool = False,
               resume: bool = False) -> SweepPlan:
    """Check everything a sweep needs, before anything runs; raise SweepInputError."""
    if overwrite and resume:
        raise SweepInputError("--overwrite and --resume exclude each other (--overwrite "
                              "re-runs every point, --resume keeps the finished ones)")
    defined = notebook_parameters(notebook)
    if OUTPUT_PARAMETER not in defined:
        raise SweepInputError(f"{notebook}: its parameters cell does not define "
                              f"{OUTPUT_PARAMETER!r}, where each run must write its results")
    for name, values in parameters.items():
        if not _NAME_RE.match(name):
            raise SweepInputError(f"-p {name!r}: not a parameter name")
        if name == OUTPUT_PARAMETER:
            raise SweepInputError(f"-p {OUTPUT_PARAMETER}: the sweep sets it (OUT/<run name>)")
        if name in RESERVED_COLUMNS:
            raise SweepInputError(f"-p {name}: the name is reserved for a results column")
        if name not in defined:
            allowed = ", ".join(n for n in defined if n != OUTPUT_PARAMETER)
            raise SweepInputError(f"{notebook}: its parameters cell does not define {name!r}; "
                                  f"it defines: {allowed}")
        if not isinstance(values, (list, tuple)) or not values:
            raise SweepInputError(f"-p {name}: give at least one value")
        keys = [text(v) + type(v).__name__ for v in values]
        if len(set(keys)) != len(keys):
            raise SweepInputError(f"-p {name}: a value is repeated in {list(values)!r}")
        check_value_types(name, values, defined[name])
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise SweepInputError(f"--out {str(out)!r} exists and is not a directory")
    if resume:
        try:
            check_resumable(out.resolve(), load_plan(out), Path(notebook).resolve(),
                            parameters)
        except ConfigError as err:
            raise SweepInputError(str(err)) from None
    elif out.is_dir() and any(out.iterdir()) and not overwrite:
        raise SweepInputError(f"--out {str(out)!r} already holds files; choose a new directory "
                              "or pass --overwrite to replace this grid's runs")
    params = {name: list(values) for name, values in parameters.items()}
    points = [dict(zip(params, combo)) for combo in itertools.product(*params.values())]
    varying = [name for name, values in params.items() if len(values) > 1]
    names = [run_name(i, len(points), p, varying) for i, p in enumerate(points)]
    return SweepPlan(Path(notebook).resolve(), out.resolve(), params, points, names)


# ------------------------------------------------------------------------- running
@dataclass
class RunOutcome:
    name: str
    status: str          # "ok" | "failed"
    error: str | None
    seconds: float


def execute_run(notebook: str, run_dir: str, parameters: dict, cwd: str,
                timeout: float | None = None) -> tuple[str, str | None, float]:
    """Run one point (in a worker process): papermill executes `notebook` into
    run_dir/notebook.ipynb with `parameters` plus output_dir=run_dir. Returns
    (status, error, seconds); never raises for a failing notebook."""
    import papermill
    from papermill.exceptions import PapermillExecutionError

    start = time.perf_counter()
    os.makedirs(run_dir, exist_ok=True)
    _quiet_papermill_inspection()
    try:
        papermill.execute_notebook(
            notebook, os.path.join(run_dir, RUN_NOTEBOOK),
            parameters={**parameters, OUTPUT_PARAMETER: run_dir},
            kernel_name="python3", kernel_manager_class=this_interpreter_kernel_manager(),
            progress_bar=False, log_output=False, cwd=cwd, execution_timeout=timeout)
    except PapermillExecutionError as err:
        return "failed", f"{err.ename}: {_first_line(err.evalue)}", time.perf_counter() - start
    except Exception as err:  # kernel died, timeout, unreadable notebook ...
        return "failed", f"{type(err).__name__}: {_first_line(str(err))}", \
            time.perf_counter() - start
    if not os.path.isfile(os.path.join(run_dir, SUMMARY_FILE)):
        return "failed", (f"MissingSummary: the notebook finished without writing "
                          f"{SUMMARY_FILE} into its {OUTPUT_PARAMETER}"), \
            time.perf_counter() - start
    return "ok", None, time.perf_counter() - start


class _SweepCheckedParameters(logging.Filter):
    """Papermill's reader of the parameters cell skips a line holding two ``=`` (``slo =
    "ttft=2,tpot=0.05"``) and then calls the value it injects for it unknown; the sweep
    checked every name with Python's parser (`notebook_parameters`) before any run, so
    those two warnings say nothing true."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not message.startswith(("Unable to parse line", "Passed unknown parameter"))


def _quiet_papermill_inspection() -> None:
    for name in ("papermill", "papermill.translators"):  # (a filter is not inherited)
        log = logging.getLogger(name)
        if not any(isinstance(f, _SweepCheckedParameters) for f in log.filters):
            log.addFilter(_SweepCheckedParameters())


def _first_line(text: str) -> str:
    text = (text or "").strip()
    return text.splitlines()[0] if text else ""


def this_interpreter_kernel_manager():
    """A kernel manager that starts the IPython kernel on *this* interpreter
    (sys.executable), whatever a ``python3`` kernelspec elsewhere on the Jupyter path
    points to, so a run sees the same labkit as the sweep."""
    from ipykernel.kernelspec import RESOURCES, get_kernel_dict
    from jupyter_client import AsyncKernelManager
    from jupyter_client.kernelspec import KernelSpec
    from traitlets import default
    import zmq

    class ThisInterpreterKernelManager(AsyncKernelManager):
        @default("transport_encryption")
        def _encrypt_when_possible(self):
            # CurveZMQ where pyzmq has it (and no plain-TCP warning from each kernel)
            return "auto" if zmq.has("curve") else "disabled"

        @property
        def kernel_spec(self):
            if self._kernel_spec is None:
                spec = get_kernel_dict()
                self._kernel_spec = KernelSpec(
                    resource_dir=RESOURCES, argv=spec["argv"], language=spec["language"],
                    display_name=spec["display_name"], metadata=spec["metadata"])
            return self._kernel_spec

        async def start_kernel(self, **kw):
            # The kernel's own log stays off the sweep's terminal: jupyter_client
            # interrupts a kernel before shutting it down, and ipykernel logs that
            # interrupt ("KeyboardInterrupt caught in kernel") whenever it lands inside a
            # message handler, at random. What a run does wrong reaches the sweep through
            # the kernel's messages (a traceback, or a dead kernel), not this stream.
            kw.setdefault("stderr", subprocess.DEVNULL)
            return await super().start_kernel(**kw)

    return ThisInterpreterKernelManager


def run_sweep(notebook: str | os.PathLike, parameters: dict[str, list],
              out: str | os.PathLike, jobs: int = 1, progress: bool | None = None,
              overwrite: bool = False, timeout: float | None = None,
              log=None, executor: str = "local", ray_address: str | None = None,
              resume: bool = False) -> pd.DataFrame:
    """Run every point of the grid and return the results table (also written to
    OUT/results.parquet). `parameters`: name -> list of values (Python objects).
    `progress`: a tqdm bar over runs (None: when stderr is a terminal). Failures are
    printed to `log` (default stderr) as they happen and kept in the table.
    `executor`: "local" (`jobs` worker processes) or "ray" (Ray tasks on the cluster at
    `ray_address`, else on a local Ray cluster of `jobs` CPUs); see `executors.py`.
    `resume`: keep the points OUT already holds complete, run the others (`resume.py`);
    how many were kept is the table's ``attrs["kept"]``.

    Ctrl-C (KeyboardInterrupt) stops the runs in progress, removes their folders,
    writes the table of the runs that finished and raises `SweepInterrupted`."""
    if not isinstance(jobs, int) or jobs < 1:
        raise SweepInputError(f"--jobs {jobs!r} must be a positive integer")
    check_executor(executor, ray_address)
    plan = plan_sweep(notebook, parameters, out, overwrite=overwrite, resume=resume)
    log = sys.stderr if log is None else log
    kept = _kept_runs(plan) if resume else {}
    _prepare_out(plan, overwrite or resume, keep=kept)
    todo = [i for i, name in enumerate(plan.names) if name not in kept]
    outcomes = _execute(plan, todo, jobs, progress, timeout, log, executor, ray_address, kept)
    frame = collect_results(plan, outcomes)
    write_parquet_atomic(frame, plan.out / RESULTS_FILE)
    frame.attrs["kept"] = len(kept)  # (points --resume kept as they were; not in the file)
    if None in outcomes:
        for name, outcome in zip(plan.names, outcomes):
            if outcome is None:  # started or not, it did not finish: no half-run folder
                shutil.rmtree(plan.out / name, ignore_errors=True)
        raise SweepInterrupted(len(frame), len(outcomes), plan.out / RESULTS_FILE)
    return frame


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped a sweep: `finished` of `total` runs are in `results`."""

    def __init__(self, finished: int, total: int, results: Path) -> None:
        super().__init__(f"{finished} of {total} runs finished; results in {results}")
        self.finished, self.total, self.results = finished, total, results


def _kept_runs(plan: SweepPlan) -> dict[str, RunOutcome]:
    """The points OUT already holds complete (--resume): name -> their outcome."""
    kept = {}
    for name, point in zip(plan.names, plan.points):
        seconds = completed_seconds(plan.out / name, point, SUMMARY_FILE)
        if seconds is not None:
            kept[name] = RunOutcome(name, "ok", None, seconds)
    return kept


def _prepare_out(plan: SweepPlan, overwrite: bool, keep=()) -> None:
    """OUT exists; with `overwrite`, the grid's run folders are cleared except `keep`."""
    plan.out.mkdir(parents=True, exist_ok=True)
    if overwrite:
        (plan.out / RESULTS_FILE).unlink(missing_ok=True)
        for name in plan.names:
            if name not in keep and (plan.out / name).is_dir():
                shutil.rmtree(plan.out / name)
    tmp = plan.out / f".{PLAN_FILE}.tmp"
    tmp.write_text(json.dumps(plan.to_json(), indent=2, default=str) + "\n")
    os.replace(tmp, plan.out / PLAN_FILE)


def _execute(plan: SweepPlan, todo: list[int], jobs: int, progress: bool | None,
             timeout: float | None, log, executor: str, ray_address: str | None,
             kept: dict[str, RunOutcome]) -> list[RunOutcome | None]:
    """Each point's outcome, in grid order (the `kept` ones as they were); None for the
    points Ctrl-C left unfinished."""
    from tqdm.auto import tqdm

    outcomes: dict[str, RunOutcome] = dict(kept)
    show = sys.stderr.isatty() if progress is None else progress
    tasks = [(str(plan.notebook), str(plan.out / plan.names[i]), plan.points[i],
              str(plan.cwd), timeout) for i in todo]
    # one bar over the whole grid: points kept by --resume count as done from the start
    bar = tqdm(total=len(plan.points), initial=len(kept), desc="sweep", unit="run",
               disable=not show)
    failed = 0
    results = run_tasks(execute_run, tasks, executor, jobs, ray_address)
    try:
        for k, result, err in results:
            name = plan.names[todo[k]]
            if err is not None:  # the worker itself died (the notebook's errors are results)
                result = ("failed", f"{type(err).__name__}: {_first_line(str(err))}", math.nan)
            status, error, seconds = result
            outcomes[name] = RunOutcome(name, status, error, seconds)
            if status == "ok":
                mark_complete(plan.out / name, plan.points[todo[k]], seconds)
            else:
                failed += 1
                message = f"labkit sweep: run {name} failed: {error}"
                if show:
                    bar.write(message, file=log)
                else:
                    print(message, file=log, flush=True)
            bar.update(1)
            bar.set_postfix(failed=failed, refresh=False)
    except KeyboardInterrupt:
        # Ctrl-C: the executor stops its workers and their kernels; what finished is kept
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C waits
        try:
            results.close()
        finally:
            signal.signal(signal.SIGINT, previous)
    finally:
        bar.close()
    return [outcomes.get(name) for name in plan.names]
