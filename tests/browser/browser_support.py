"""Helpers for the browser tests: open a notebook in JupyterLab, run it, take pictures
(test-artifacts/)."""

import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ARTEFACTS = REPO / "test-artifacts"
TOKEN = "labkit-browser-test"


def open_notebook(browser, lab, path: str, width: int = 1280, height: int = 1000):
    """A page with the notebook open and its kernel ready."""
    url, _ = lab
    page = browser.new_page(viewport={"width": width, "height": height})
    page.goto(f"{url}/lab/tree/{path}?token={TOKEN}", timeout=120_000)
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']",
                           timeout=120_000)
    no = page.get_by_role("button", name="No", exact=True)  # the news pop-up
    if no.count():
        no.first.click()
    return page


def run_all(page, cells: int) -> None:
    """Run every cell; wait until the last of `cells` code cells has run."""
    # "idle" can show before the kernel's connection is up: retry until cell 1 ran
    for _ in range(6):
        time.sleep(2)
        page.get_by_text("Run", exact=True).first.click()
        page.get_by_text("Run All Cells", exact=True).first.click()
        try:
            page.wait_for_function(
                "[...document.querySelectorAll('.jp-InputPrompt')]"
                ".some(p => p.textContent.includes('[1]'))", timeout=30_000)
            break
        except Exception:
            continue
    page.wait_for_function(
        f"[...document.querySelectorAll('.jp-InputPrompt')]"
        f".some(p => p.textContent.includes('[{cells}]'))"
        f" || document.querySelector('.jp-OutputArea-output[data-mime-type="
        f"\"application/vnd.jupyter.stderr\"] .ansi-red-fg')", timeout=240_000)
    errors = page.locator(".jp-OutputArea-output:has(.ansi-red-fg)")
    if errors.count():
        raise AssertionError(f"a cell failed:\n{errors.first.inner_text()[-2000:]}")
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']",
                           timeout=240_000)


def shoot(page, name: str, element=None) -> Path:
    """Save a picture of the page (or one element of it) as test-artifacts/name.png."""
    time.sleep(1.5)  # let plotly finish drawing
    path = ARTEFACTS / f"{name}.png"
    (element or page).screenshot(path=str(path))
    return path
