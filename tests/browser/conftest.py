"""JupyterLab in headless Chromium: a server on a copy of `notebooks/` (so nothing a
test opens or runs is saved into the repository) and a browser. Needs Debian's
`chromium` (`.ci/run` installs it) and Playwright (the test extra); pictures go to
test-artifacts/."""

import os
import shutil
import subprocess
import sys

import pytest

from browser_support import ARTEFACTS, REPO, TOKEN
from support import free_port, wait_until_serving

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Flags for a sandboxed, offline machine (no GPU, no network beyond localhost).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-dev-shm-usage"]


def pytest_collection_modifyitems(items):
    if CHROMIUM is None:
        skip = pytest.mark.skip(reason="Debian's chromium is not installed "
                                       "(apt-get install chromium; .ci/run does it)")
        for item in items:
            if "browser" in str(item.fspath):
                item.add_marker(skip)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """(url, root): JupyterLab serving a fresh copy of notebooks/ at root."""
    tmp = tmp_path_factory.mktemp("lab")
    root = tmp / "notebooks"
    shutil.copytree(REPO / "notebooks", root,
                    ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    # draw every cell, also those off screen (JupyterLab skips them by default), so
    # whole-notebook pictures show every figure
    settings = tmp / "config" / "lab" / "user-settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    (settings / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none"}')
    port = free_port()
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp / "config"),
               JUPYTER_RUNTIME_DIR=str(tmp / "runtime"), IPYTHONDIR=str(tmp / "ipython"))
    log = open(tmp / "lab.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root",
         f"--port={port}", "--ServerApp.ip=127.0.0.1", f"--ServerApp.token={TOKEN}",
         f"--ServerApp.root_dir={root}", f"--LabApp.workspaces_dir={tmp / 'workspaces'}",
         "--LabApp.news_url=None"],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_until_serving(proc, url, TOKEN, tmp / "lab.log", "JupyterLab")
    try:
        yield url, root
    finally:
        proc.terminate()
        proc.wait(timeout=20)


@pytest.fixture
def browser():
    from playwright.sync_api import sync_playwright

    ARTEFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                      args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()
