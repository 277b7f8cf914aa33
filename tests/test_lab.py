"""`labkit lab` for real: a Jupyter server started the way `make lab` starts it, driven
through its contents API as JupyterLab drives it when it saves.

Saving a tracked notebook with new outputs, execution counts and widget state (what
running it and autosaving does) must leave `git diff` empty; editing a cell must save
(without widget state); an untracked notebook saves as sent; the project root is
served (runs/ reachable) and notebooks/ opens first.
"""

import http.client
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.lab import lab_command
from support import free_port, wait_until_serving

REPO = Path(__file__).resolve().parents[1]
TUTORIAL = "notebooks/tutorials/01_paged_kv.ipynb"
TOKEN = "labkit-lab-test"


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A git repository holding a tutorial, served by `labkit lab`."""
    root = tmp_path_factory.mktemp("project")
    (root / TUTORIAL).parent.mkdir(parents=True)
    shutil.copy(REPO / TUTORIAL, root / TUTORIAL)
    (root / "runs" / "sweep").mkdir(parents=True)
    _git(root, "init", "-q")
    _git(root, "add", TUTORIAL)
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "tutorial")
    port = free_port()
    state = tmp_path_factory.mktemp("jupyter")
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(state / "config"),
               JUPYTER_RUNTIME_DIR=str(state / "runtime"), IPYTHONDIR=str(state / "ipython"))
    log = open(state / "lab.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "labkit.cli", "lab", "--no-browser", f"--port={port}",
         "--ServerApp.ip=127.0.0.1", f"--ServerApp.token={TOKEN}",
         f"--LabApp.workspaces_dir={state / 'workspaces'}", "--LabApp.news_url=None"],
        cwd=root, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_until_serving(proc, url, TOKEN, state / "lab.log", "labkit lab")
    yield root, port
    proc.terminate()
    proc.wait(timeout=30)


def _api(port: int, method: str, path: str, body=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request(method, path, body=None if body is None else json.dumps(body),
                 headers={"Authorization": f"token {TOKEN}", "Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, response.getheader("Location"), data


def _get(port: int, path: str) -> dict:
    status, _, data = _api(port, "GET", f"/api/contents/{path}?content=1")
    assert status == 200, data
    return json.loads(data)["content"]


def _save(port: int, path: str, notebook: dict) -> None:
    status, _, data = _api(port, "PUT", f"/api/contents/{path}",
                           {"type": "notebook", "format": "json", "content": notebook})
    assert status in (200, 201), data


def _as_if_run(notebook: dict) -> dict:
    """What running every cell and autosaving sends: new outputs and widget state."""
    for i, cell in enumerate(notebook["cells"]):
        if cell["cell_type"] == "code":
            cell["execution_count"] = 100 + i
            cell["outputs"] = [{"output_type": "stream", "name": "stdout",
                                "text": f"another run {i}\n"}]
    notebook["metadata"]["widgets"] = {"application/vnd.jupyter.widget-state+json": {
        "state": {"abc": {"model_name": "LayoutModel"}}, "version_major": 2,
        "version_minor": 0}}
    return notebook


def test_saving_an_unedited_tracked_notebook_leaves_git_clean(project):
    root, port = project
    before = (root / TUTORIAL).read_bytes()
    _save(port, TUTORIAL, _as_if_run(_get(port, TUTORIAL)))
    assert _git(root, "status", "--porcelain", "--", TUTORIAL).stdout == ""
    assert (root / TUTORIAL).read_bytes() == before


def test_an_edited_tracked_notebook_saves_without_widget_state(project):
    root, port = project
    notebook = _as_if_run(_get(port, TUTORIAL))
    notebook["cells"][0]["source"] += "\nA note of mine."
    _save(port, TUTORIAL, notebook)
    try:
        saved = json.loads((root / TUTORIAL).read_text())
        assert saved["cells"][0]["source"][-1] == "A note of mine."
        assert "widgets" not in saved["metadata"]
        assert _git(root, "status", "--porcelain", "--", TUTORIAL).stdout.strip()
    finally:
        _git(root, "checkout", "--", TUTORIAL)


def test_untracked_notebooks_save_as_sent_and_runs_is_served(project):
    root, port = project
    path = "runs/sweep/mine.ipynb"
    notebook = _as_if_run(_get(port, TUTORIAL))
    _save(port, path, notebook)
    saved = json.loads((root / path).read_text())
    assert saved["metadata"]["widgets"] == notebook["metadata"]["widgets"]
    code = next(i for i, c in enumerate(notebook["cells"]) if c["cell_type"] == "code")
    assert "".join(saved["cells"][code]["outputs"][0]["text"]) == f"another run {code}\n"
    status, _, listing = _api(port, "GET", "/api/contents/runs/sweep")
    assert status == 200 and "mine.ipynb" in listing.decode()


def test_notebooks_open_first(project):
    _, port = project
    status, location, _ = _api(port, "GET", "/")
    assert status in (301, 302) and location.split("?")[0].endswith("/lab/tree/notebooks")


def test_lab_puts_this_environment_on_path(tmp_path):
    argv, env = lab_command(tmp_path, ["--port", "1"])
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    assert (Path(env["PATH"].split(os.pathsep)[0]) / "labkit").exists()
    assert f"--ServerApp.root_dir={tmp_path}" in argv and argv[-2:] == ["--port", "1"]
    assert not any(a.startswith("--LabApp.default_url") for a in argv)  # no notebooks/ here
