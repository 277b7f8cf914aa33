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
    # ?reset: a fresh workspace, so notebooks of earlier tests do not open again beside it
    page.goto(f"{url}/lab/tree/{path}?reset&token={TOKEN}", timeout=120_000)
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']",
                           timeout=120_000)
    no = page.get_by_role("button", name="No", exact=True)  # the news pop-up
    if no.count():
        no.first.click()
    return page


# the notebook on screen: other notebooks opened earlier in the same JupyterLab stay in
# the page as hidden tabs, with their own prompts, outputs and figures
ACTIVE = ".jp-NotebookPanel:not(.lm-mod-hidden)"


def run_all(page, timeout_s: float = 300) -> None:
    """Run every cell and wait until each code cell has run (a failed cell raises)."""
    time.sleep(3)  # "idle" can show before the kernel's connection is up
    # stored outputs and prompts first go, so what is seen next is this run's
    page.get_by_text("Edit", exact=True).first.click()
    page.get_by_text("Clear Outputs of All Cells", exact=True).first.click()
    page.wait_for_function(f"[...document.querySelectorAll('{ACTIVE} .jp-CodeCell "
                           f".jp-InputPrompt')].every(p => !/[0-9]/.test(p.textContent))",
                           timeout=30_000)
    started = time.monotonic()
    clicked = None
    while time.monotonic() - started < timeout_s:
        prompts = page.eval_on_selector_all(f"{ACTIVE} .jp-CodeCell .jp-InputPrompt",
                                            "els => els.map(e => e.textContent)")
        errors = page.locator(f"{ACTIVE} .jp-OutputArea-output:has(.ansi-red-fg)")
        if errors.count():
            raise AssertionError(f"a cell failed:\n{errors.first.inner_text()[-2000:]}")
        if prompts and all(any(c.isdigit() for c in p) for p in prompts):
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']",
                                   timeout=60_000)
            return
        if not any("*" in p or any(c.isdigit() for c in p) for p in prompts) and \
                (clicked is None or time.monotonic() - clicked > 30):
            page.get_by_text("Run", exact=True).first.click()  # (again, if nothing ran)
            page.get_by_text("Run All Cells", exact=True).first.click()
            clicked = time.monotonic()
        time.sleep(1)
    raise AssertionError(f"the notebook did not finish in {timeout_s} s: {prompts}")


PLOTS = """() => [...document.querySelectorAll('%s .js-plotly-plot')].map(g => {
  const r = g.getBoundingClientRect();
  const cell = g.closest('.jp-OutputArea-output').getBoundingClientRect();
  return {title: String(g.layout && g.layout.title && g.layout.title.text || ''),
          traces: (g.data || []).length, left: r.left, right: r.right,
          width: r.width, height: r.height, cell_left: cell.left, cell_right: cell.right};
})""" % ACTIVE


def plots(page) -> list[dict]:
    """Every plotly figure of the notebook on screen: title, traces, where it is, its
    cell's edges."""
    return page.evaluate(PLOTS)


def shoot(page, name: str, element=None) -> Path:
    """Save a picture of the page (or one element of it) as test-artifacts/name.png."""
    no = page.get_by_role("button", name="No", exact=True)  # the news pop-up
    if no.count():
        no.first.click()
    time.sleep(1.5)  # let plotly finish drawing
    path = ARTEFACTS / f"{name}.png"
    (element or page).screenshot(path=str(path))
    return path
