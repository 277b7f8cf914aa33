"""A sweep that is killed leaves nothing running; one stopped with Ctrl-C ends cleanly.

Issue 12, item 8. A real `labkit sweep` runs in a subprocess over a notebook whose
runs block (a cell sleeps for two minutes); every process it starts — its workers,
their Jupyter kernels, multiprocessing's resource tracker — inherits a marker in its
environment, so the test finds them all in /proc, whoever their parent is by then.

- SIGKILL to the sweep: within a few seconds no process with the marker is left.
- SIGINT (Ctrl-C) after one run finished and while another is running: exit 130, one
  line saying "interrupted", results.parquet holds the finished run, the interrupted
  run's folder is gone, and nothing keeps running.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import nbformat
import pandas as pd
from nbformat.v4 import new_code_cell, new_notebook

SLOW_SOURCE = '''
import json, os, time
os.makedirs(output_dir, exist_ok=True)
if x >= 2:
    open(os.path.join(output_dir, "started"), "w").close()
    time.sleep(120)
with open(os.path.join(output_dir, "summary.json"), "w") as f:
    json.dump({"x": x}, f)
'''


def slow_notebook(path: Path) -> Path:
    params = new_code_cell("x = 1\noutput_dir = None")
    params.metadata["tags"] = ["parameters"]
    nb = new_notebook(cells=[params, new_code_cell(SLOW_SOURCE.strip())])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, path)
    return path


def marked(marker: str) -> list[int]:
    """Pids of live processes whose environment holds the marker (zombies excluded)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker.encode() not in (entry / "environ").read_bytes():
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            pids.append(int(entry.name))
    return pids


def start_sweep(tmp_path: Path, values: str, jobs: int) -> tuple[subprocess.Popen, str, Path]:
    marker = f"LABKIT_SWEEP_TEST={uuid.uuid4().hex}"
    env = {**os.environ, marker.split("=")[0]: marker.split("=")[1]}
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "labkit.cli", "sweep", str(slow_notebook(tmp_path / "nb.ipynb")),
         "-p", "x", values, "--out", str(out), "--jobs", str(jobs), "--no-progress"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as a shell's
    # foreground job: an ignored SIGINT is inherited, whatever the test worker did with it
    return proc, marker, out


def wait_for(predicate, seconds: float, what: str) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def reap_all(marker: str) -> None:
    """Test hygiene: whatever the assertion said, nothing of this sweep stays alive."""
    for pid in marked(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_killed_sweep_leaves_no_process_behind(tmp_path):
    proc, marker, out = start_sweep(tmp_path, "2,3,4,5", jobs=2)
    try:
        # two runs are inside their slow cell: workers and kernels are all up
        wait_for(lambda: len(list(out.glob("*/started"))) == 2, 120, "two runs to start")
        assert len(marked(marker)) >= 4  # the sweep, 2 workers, 2 kernels (+ helpers)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        wait_for(lambda: not marked(marker), 15, "every process of the sweep to end")
    finally:
        proc.kill()
        reap_all(marker)


def test_ctrl_c_stops_a_sweep_cleanly_and_keeps_what_finished(tmp_path):
    proc, marker, out = start_sweep(tmp_path, "1,2,3", jobs=1)
    try:
        wait_for(lambda: list(out.glob("*/started")), 120, "the second run to start")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130
        lines = err.strip().splitlines()
        assert "Traceback" not in err and len(lines) == 1 and "interrupted" in lines[0], err
        results = pd.read_parquet(out / "results.parquet")
        assert results["run"].tolist() == ["0_x=1"] or results["run"].tolist() == ["00_x=1"]
        assert results["status"].tolist() == ["ok"] and results["x"].tolist() == [1]
        assert not (out / "01_x=2").exists() and not (out / "02_x=3").exists()
        wait_for(lambda: not marked(marker), 15, "every process of the sweep to end")
    finally:
        proc.kill()
        reap_all(marker)
