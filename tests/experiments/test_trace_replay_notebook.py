"""trace_replay.ipynb executed by papermill: a part of a trace file (the rows of one
model, a window, a faster clock) replayed open loop — the files it writes hold exactly
the calls of that part, at the times the cut gives them, and its load curve agrees with
its own run."""

from __future__ import annotations

import json

import nbformat
import pandas as pd
import pytest
from sweep_helpers import TRACE_REPLAY

from labkit.traces import generate_random_trace


def test_a_window_of_a_trace_file_replayed_open_loop(tmp_path):
    import papermill

    load = generate_random_trace(num_prompts=180, request_rate=6.0, input_len=512,
                                 output_len=32, seed=5)
    path = tmp_path / "load.csv"  # as BurstGPT: two models, the load's calls
    path.write_text("Timestamp,Model,Request tokens,Response tokens\n" + "".join(
        f"{r.timestamp!r},{'GPT-4' if i % 3 else 'ChatGPT'},{r.input_length},"
        f"{r.output_length}\n" for i, r in enumerate(load.requests)))
    out = tmp_path / "run"
    params = dict(trace=str(path), where="Model=GPT-4", window="5:20", speedup=2.0,
                  load_curve="1,4",
                  slo="ttft=0.2,tpot=0.02", output_dir=str(out))
    papermill.execute_notebook(str(TRACE_REPLAY), str(tmp_path / "executed.ipynb"),
                               parameters=params, kernel_name="python3", progress_bar=False,
                               cwd=str(TRACE_REPLAY.parent))

    summary = json.loads((out / "summary.json").read_text())
    requests = pd.read_parquet(out / "requests.parquet")
    # GPT-4's calls of the window, each at (t - 5) / 2, all of them served
    kept = {f"bg-{i + 2}": (r.timestamp - 5.0) / 2.0 for i, r in enumerate(load.requests)
            if i % 3 and 5.0 <= r.timestamp < 20.0}
    assert dict(zip(requests["request_id"], requests["arrival_s"], strict=True)) == \
        pytest.approx(kept)
    assert summary["open_loop"] is True and summary["requests_completed"] == len(kept) > 20
    assert summary["slo_attainment"] is not None and summary["usd_per_m_tokens"] > 0

    nb = nbformat.read(tmp_path / "executed.ipynb", as_version=4)
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.outputs if o.output_type == "stream")
    times = sorted(kept.values())
    rate = (len(times) - 1) / (times[-1] - times[0])
    assert f"{len(kept)} calls in {len(kept)} sessions" in text
    assert f"-> {rate:.2f} calls/s offered" in text
    # the load curve: x1 is the run above, x4 the same calls four times as fast
    curve = next(o["text"] for c in nb.cells if c.cell_type == "code"
                 and "curve = pd.DataFrame" in c.source for o in c.outputs)
    lines = curve.strip().splitlines()
    assert lines[0].split() == ["rate_x", "offered_req_s", "goodput_req_s", "slo_attainment",
                                "ttft_p90_s", "tpot_p90_s", "usd_per_m_tokens"]
    one, four = lines[1].split(), lines[2].split()
    assert float(one[0]) == 1 and float(four[0]) == 4
    assert float(one[2]) == pytest.approx(summary["goodput_req_s"], rel=1e-3)
    assert float(four[1]) == pytest.approx(4 * rate, rel=1e-3)
    figures = sum("application/vnd.plotly.v1+json" in o.get("data", {})
                  for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert figures == 2
