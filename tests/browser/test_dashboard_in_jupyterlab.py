"""The dashboard, for real: JupyterLab in headless Chromium, driven by clicks.

A scratch notebook shows a Dashboard (Qwen3-30B-A3B as DEP2). The test then does what
a reader does — picks DeepSeek-V3, layout DCP with degree 8, *rebuild*, *step* — and
checks the placement figure on the page (eight GPU bands, each holding one token in
eight of every request) and the view's data in the kernel; then types a layout the
model refuses into *exact*, rebuilds, and checks that the refusal is on screen and no
figure is left. Pictures: test-artifacts/dashboard-dcp8.png, dashboard-refused.png.
"""

import json
import re
import time

import nbformat

from browser_support import open_notebook, run_all, shoot

SETUP = """\
from labkit import generate_agentx_trace
from labkit.widgets import Dashboard
trace = generate_agentx_trace(4, seed=1, block_size=64, shared_prefix_tokens=1024,
                              initial_context_median=3000, output_median=60,
                              tool_result_median=300, main_calls_median=6,
                              context_window_tokens=40_000, compact_threshold_tokens=20_000)
dash = Dashboard(trace, model="qwen3-30b-a3b", layout="dep2", hardware="h200",
                 concurrency=4, duration_s=20)
dash"""
CHECK = """\
import json
p = dash.views["placement"].placement(dash.shown_step) if dash.views else None
print("RESULT", json.dumps(None if p is None else {
    "layout": dash.engine.layout.text, "step": dash.shown_step,
    "gpus": sorted(set(p.gpu.tolist())),
    "ownership": sorted({(int(r.gpu), int(r.shards), int(r.shard), int(r.interleave))
                         for r in p.itertuples()}),
    "requests": int(p.request_id.nunique())}))"""

PLACEMENT = """() => {
  const gd = [...document.querySelectorAll('.js-plotly-plot')]
    .find(g => g.layout && String(g.layout.title && g.layout.title.text)
      .startsWith('KV placement'));
  return gd ? {title: gd.layout.title.text, ticks: gd.layout.yaxis.ticktext || []} : null;
}"""


def test_pick_dcp_rebuild_step_then_a_refused_layout(lab, browser):
    _, root = lab
    nb = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(SETUP), nbformat.v4.new_code_cell(CHECK)],
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                 "language": "python"}})
    nbformat.write(nb, root / "browser_dashboard.ipynb")
    page = open_notebook(browser, lab, "browser_dashboard.ipynb", width=1280, height=1400)
    try:
        run_all(page)
        dashboard = page.locator(".widget-vbox").first
        page.wait_for_function(PLACEMENT, timeout=120_000)
        _select(page, "model", "deepseek-v3")
        _select(page, "layout", "DCP")
        _select(page, "degree", "8  (tp8xdcp8)")
        assert page.locator(".widget-text:has(label:text-is('exact')) input").input_value() \
            == "tp8xdcp8"
        page.get_by_role("button", name="rebuild").click()
        page.wait_for_function("document.body.innerText.includes('tp8xdcp8 on 8 x h200')",
                               timeout=120_000)
        for _ in range(3):
            page.get_by_role("button", name="step").click()
        page.wait_for_function("document.body.innerText.includes('step 3 of')",
                               timeout=60_000)
        page.wait_for_function(
            PLACEMENT.replace("return gd ?", "return gd && gd.layout.title.text.includes("
                              "'tp8xdcp8') && gd.layout.title.text.includes('after step 3') ?"),
            timeout=60_000)
        figure = page.evaluate(PLACEMENT)
        shoot(page, "dashboard-dcp8", dashboard)
        result = _run_check(page)

        # a layout the model refuses: the refusal stays, no figure is left
        exact = page.locator(".widget-text:has(label:text-is('exact')) input")
        exact.fill("tp8xdcp16")
        exact.press("Enter")
        page.get_by_role("button", name="rebuild").click()
        page.wait_for_function("document.body.innerText.includes('cannot build tp8xdcp16')",
                               timeout=60_000)
        figures_left = dashboard.locator(".js-plotly-plot").count()
        stepped = page.get_by_role("button", name="step").is_disabled()
        refused = _run_check(page)
        shoot(page, "dashboard-refused", dashboard)
        status = page.inner_text("body")
    except Exception:
        shoot(page, "dashboard-failure")
        raise
    finally:
        page.close()

    # the page: eight GPU bands; each keeps one token in eight of every request
    assert "tp8xdcp8" in figure["title"] and len(figure["ticks"]) == 8
    total = int(re.search(r"([\d,]+) tokens", figure["title"]).group(1).replace(",", ""))
    held = [int(re.search(r"([\d,]+) tok", t).group(1).replace(",", "")) for t in figure["ticks"]]
    assert sum(held) == total and max(held) - min(held) <= result["requests"]
    # the kernel: GPU g holds positions p with p % 8 == g (interleave 1)
    assert result["layout"] == "tp8xdcp8" and result["step"] == 3
    assert result["gpus"] == list(range(8))
    assert result["ownership"] == [[g, 8, g, 1] for g in range(8)]
    # refused: said so, nothing stale left, nothing to step
    assert figures_left == 0 and stepped and refused is None
    assert "dcp16 must divide the tp*pcp group" in status


def _select(page, label: str, option: str) -> None:
    page.locator(f".widget-dropdown:has(label:text-is('{label}')) select").select_option(
        label=option)
    time.sleep(0.5)  # the kernel recomputes the other choices


def _run_check(page):
    """Run the check cell again and read its RESULT line."""
    cell = page.locator(".jp-CodeCell").nth(1)
    before = cell.locator(".jp-OutputArea-output").all_inner_texts()
    cell.locator(".jp-InputArea-editor").click()
    page.keyboard.press("Shift+Enter")
    page.wait_for_function(
        """([n, before]) => {
            const out = document.querySelectorAll('.jp-CodeCell')[n]
                .querySelector('.jp-OutputArea-output');
            return out && out.innerText.includes('RESULT') && out.innerText !== before;
        }""", arg=[1, before[0] if before else ""], timeout=60_000)
    text = cell.locator(".jp-OutputArea-output").first.inner_text()
    return json.loads(text.split("RESULT", 1)[1].strip())
