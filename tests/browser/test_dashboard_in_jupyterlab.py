"""The dashboard, for real: JupyterLab in headless Chromium runs the dashboard
tutorial and the widget views render. A screenshot is saved as a test artefact
(test-artifacts/dashboard.png). Needs Debian's `chromium` (`.ci/run` installs it)."""

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = "tutorials/09_workbench_dashboard.ipynb"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
TOKEN = "labkit-browser-test"
# Flags for a sandboxed, offline machine (no GPU, no network beyond localhost).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-dev-shm-usage"]

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed "
                                "(apt-get install chromium; .ci/run does it)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lab")
    port = _free_port()
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp / "config"),
               JUPYTER_RUNTIME_DIR=str(tmp / "runtime"), IPYTHONDIR=str(tmp / "ipython"))
    log = open(tmp / "lab.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root",
         f"--port={port}", "--ServerApp.ip=127.0.0.1", f"--ServerApp.token={TOKEN}",
         f"--ServerApp.root_dir={REPO / 'notebooks'}",
         f"--LabApp.workspaces_dir={tmp / 'workspaces'}", "--LabApp.news_url=None"],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(120):
        try:
            urllib.request.urlopen(f"{url}/api/status?token={TOKEN}", timeout=2)
            break
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.5)
    else:
        proc.terminate()
        pytest.fail(f"JupyterLab did not start:\n{(tmp / 'lab.log').read_text()[-3000:]}")
    yield url
    proc.terminate()
    proc.wait(timeout=20)


def test_dashboard_renders(lab):
    from playwright.sync_api import sync_playwright

    artefacts = REPO / "test-artifacts"
    artefacts.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1700, "height": 1300})
        try:
            _run_dashboard(page, lab, artefacts)
            plots = page.locator(".js-plotly-plot").count()
            titles = page.eval_on_selector_all(".js-plotly-plot .gtitle",
                                               "els => els.map(e => e.textContent || '')")
        except Exception:
            page.screenshot(path=str(artefacts / "dashboard-failure.png"), full_page=True)
            raise
        finally:
            browser.close()
    assert plots >= 4
    assert any("Lockstep" in t for t in titles)
    assert any("Block tables" in t for t in titles)
    assert (artefacts / "dashboard.png").stat().st_size > 20_000


def _run_dashboard(page, lab, artefacts):
    page.goto(f"{lab}/lab/tree/{NOTEBOOK}?token={TOKEN}", timeout=120_000)
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']",
                           timeout=120_000)
    # "idle" can show before the kernel's connection is up; run all until cell 1 ran
    for _ in range(6):
        time.sleep(3)
        page.get_by_text("Run", exact=True).first.click()
        page.get_by_text("Run All Cells", exact=True).first.click()
        try:
            page.wait_for_function(
                "[...document.querySelectorAll('.jp-InputPrompt')]"
                ".some(p => p.textContent.includes('[1]'))", timeout=20_000)
            break
        except Exception:
            continue
    # the dashboard: its buttons, and its four plotly figures drawn
    page.wait_for_selector("button:has-text('play')", timeout=180_000)
    page.wait_for_function(
        "document.querySelectorAll('.js-plotly-plot').length >= 4", timeout=180_000)
    no = page.get_by_role("button", name="No", exact=True)  # the news pop-up
    if no.count():
        no.first.click()
    page.locator(".js-plotly-plot").nth(1).scroll_into_view_if_needed()
    time.sleep(2)  # let the figures finish drawing before the picture
    page.screenshot(path=str(artefacts / "dashboard.png"), full_page=True)
