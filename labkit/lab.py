"""`labkit lab` (what `make lab` runs): JupyterLab over the project, safe to browse.

Three things a plain `jupyter lab notebooks/` gets wrong for this project:

- **Looking must not change tracked files.** The tutorials keep their outputs in git
  (nbval compares a fresh run with them), so running a cell and letting JupyterLab
  autosave would rewrite a tracked tutorial — new outputs, execution counts, widget
  state — just by looking. `keep_tracked_notebooks`, a pre-save hook of the Jupyter
  server's contents manager, writes such a notebook back exactly as it is on disk
  when none of its cells' sources changed; the outputs stay in the browser. Edit a
  cell and the save goes through (without widget state, which the repository never
  keeps). Notebooks git does not track (your own, sweep outputs) save as usual.
- **Sweep outputs must be reachable.** The server's root is the project folder, so
  `runs/` is browsable next to `notebooks/`, which opens first.
- **The command line must work in its terminals.** The server runs with this
  environment's `bin/` first on PATH, so `labkit ...` works in a JupyterLab terminal
  and in `!labkit ...` cells.

    labkit lab [jupyter lab options]     # e.g. labkit lab --port 8899 --no-browser
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HOOK = "labkit.lab.keep_tracked_notebooks"


def lab_command(root: Path, extra: list[str]) -> tuple[list[str], dict]:
    """The argv and environment that start JupyterLab on `root`."""
    argv = [sys.executable, "-m", "jupyter", "lab", f"--ServerApp.root_dir={root}",
            f"--ContentsManager.pre_save_hook={HOOK}"]
    if (root / "notebooks").is_dir():
        argv.append("--LabApp.default_url=/lab/tree/notebooks")
    if hasattr(os, "getuid") and os.getuid() == 0:
        argv.append("--allow-root")
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return argv + extra, env


def run_lab(extra: list[str]) -> int:
    """Replace this process with JupyterLab on the current folder."""
    try:
        import jupyterlab  # noqa: F401
    except ImportError:
        print("labkit lab: JupyterLab is not installed (pip install -e '.[lab]', or make lab)",
              file=sys.stderr)
        return 2
    argv, env = lab_command(Path.cwd(), extra)
    os.execve(argv[0], argv, env)
    return 0  # not reached


# ----------------------------------------------------------------- the save hook
def keep_tracked_notebooks(model: dict, path: str, contents_manager, **_) -> None:
    """Pre-save hook: a git-tracked notebook whose cell sources are unchanged is saved
    as it already is on disk; an edited one loses its widget state (see above)."""
    if model.get("type") != "notebook" or not isinstance(model.get("content"), dict):
        return
    file = Path(contents_manager.root_dir) / path.lstrip("/")
    if not file.is_file() or not _tracked(file):
        return
    import nbformat

    on_disk = nbformat.read(file, as_version=nbformat.NO_CONVERT)
    if _sources(on_disk) == _sources(model["content"]):
        model["content"] = on_disk
    else:
        model["content"].get("metadata", {}).pop("widgets", None)


def _sources(notebook: dict) -> list[tuple[str, str]]:
    """What a person edits: each cell's type and source text."""
    out = []
    for cell in notebook.get("cells", []):
        source = cell.get("source", "")
        out.append((cell.get("cell_type"), "".join(source) if isinstance(source, list)
                    else source))
    return out


def _tracked(file: Path) -> bool:
    try:
        done = subprocess.run(["git", "ls-files", "--error-unmatch", "--", file.name],
                              cwd=file.parent, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0
