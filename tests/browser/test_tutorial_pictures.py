"""The dashboard and compare tutorials, and the open-loop trace replay experiment, in
JupyterLab, pictured at 1280 and 1920 px.

Each notebook runs once in headless Chromium; the page is photographed at 1280 px,
then widened to 1920 px and photographed again (test-artifacts/<tutorial>-<width>.png).
Every figure must be drawn (traces, a height), fill its cell and lie inside it:
nothing cut off at either width (the figures follow the notebook as it widens).
"""

import pytest

from browser_support import open_notebook, plots, run_all, shoot

NOTEBOOKS = {"tutorials/09_workbench_dashboard": 5,  # placement, lockstep, KV, blocks, prefix
             "tutorials/11_compare_layouts": 7,  # one timeline, three layouts x (placement, blocks)
             "experiments/trace_replay": 2}  # load over time, goodput and latency against load


@pytest.mark.parametrize("notebook", list(NOTEBOOKS))
def test_tutorial_pictures(lab, browser, notebook):
    tutorial = notebook.split("/")[-1]
    page = open_notebook(browser, lab, f"{notebook}.ipynb", width=1280, height=4400)
    try:
        run_all(page)
        seen = {}
        for width in (1280, 1920):
            page.set_viewport_size({"width": width, "height": 4400})
            shoot(page, f"{tutorial}-{width}")
            seen[width] = plots(page)
    except Exception:
        shoot(page, f"{tutorial}-failure")
        raise
    finally:
        page.close()
    for width, figures in seen.items():
        assert len(figures) == NOTEBOOKS[notebook], [f["title"] for f in figures]
        for f in figures:
            assert f["traces"] > 0 and f["height"] > 150, f
            assert f["cell_left"] - 1 <= f["left"] and f["right"] <= f["cell_right"] + 1, f
            assert f["right"] <= width, f
            assert f["width"] >= 0.9 * (f["cell_right"] - f["cell_left"]), f  # fills its cell
