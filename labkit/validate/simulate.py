"""Replay one measured run on the simulated engine and measure it as the client did.

The engine is the run's deployment — model preset, TP layout, GPU, vLLM's knobs
(`max_num_batched_tokens`, `max_num_seqs` 128, `max_model_len` 4096, memory
utilisation) and vLLM's defaults otherwise (prefix caching, chunked prefill, CUDA
graphs FULL_AND_PIECEWISE, async scheduling) — fed the run's workload open loop. The
metrics are the client's: TTFT and E2E of every request, their means and 90th
percentiles, TPOT from the means (`runs.py`), throughput as tokens sent and received
per second of sending.

Two things the engine does not see are added here:

- the **front end**: the measured latencies are the client's, through vLLM's OpenAI
  server — request parsing and tokenisation on the way in, detokenisation and the
  HTTP stream on the way out — a fixed `FRONTEND_S` per request on TTFT and E2E,
  fitted with the step overheads on the fitted runs (`fit.py`);
- the **cold cycle**: the first 100 requests find no cached prompt. At the measured
  durations they are 1-3 % of a run; a shortened replay (`duration_scale`) would
  inflate that share, so they are replayed (they warm the cache) but left out of the
  statistics.
"""

from __future__ import annotations

import numpy as np

from labkit.costmodel import CostModel
from labkit.engine.capacity import placement_for
from labkit.engine.engine import Engine
from labkit.engine.sim.layer_model import LayerStepModel
from labkit.engine.sim.overheads import FITTED, OverheadParams
from labkit.specs import EngineConfig, Layout, get_hardware, get_model
from labkit.validate.runs import GROUPS, PROMPTS_PER_GROUP
from labkit.validate.workload import shared_prefix_trace

# ---- fitted (python -m labkit.validate.fit), with overheads.FITTED
FRONTEND_S = 8.192e-3


def engine_for(run, params: OverheadParams = FITTED) -> Engine:
    """The simulated deployment of a run, its step overheads priced with `params`."""
    model, hardware = get_model(run["model"]), get_hardware(run["hardware"])
    config = EngineConfig.from_knobs(**run["knobs"])
    placement = placement_for(model, Layout.parse(run["layout"]), config)
    step_model = LayerStepModel.from_config(placement, CostModel(hardware), config, params)
    return Engine(model, run["layout"], hardware, cost_model=step_model, config=config)


def simulate_run(run, duration_scale: float = 0.1, params: OverheadParams = FITTED,
                 frontend_s: float = FRONTEND_S) -> dict:
    """The client-side metrics of one replayed run (seconds; throughput in tokens/s),
    and under "stages" the same per load stage: those of the requests sent in it."""
    trace = shared_prefix_trace(run["stages"], int(round(run["prompt_len"])),
                                int(run["system_len"]), int(run["output_len"]), duration_scale)
    engine = engine_for(run, params)
    table = engine.replay(trace, open_loop=True).requests.sort_values("arrival_s")
    warm = table.iloc[GROUPS * PROMPTS_PER_GROUP:]
    done = warm[warm["completed"].astype(bool)]
    sending = sum(seconds for _, seconds in run["stages"]) * duration_scale
    done_all = table[table["completed"].astype(bool)]
    tokens = float((done_all["input_tokens"] + done_all["output_tokens"]).sum())
    ends = np.cumsum([seconds * duration_scale for _, seconds in run["stages"]])
    stage = np.searchsorted(ends, done["arrival_s"].to_numpy(), side="right")
    stages = [_client_metrics(done[stage == k], run["output_len"], frontend_s)
              for k in range(len(ends))]
    return {**_client_metrics(done, run["output_len"], frontend_s),
            "throughput": tokens / sending, "completed": int(len(done_all)),
            "requests": int(len(table)), "stages": stages}


def _client_metrics(done, output_len: int, frontend_s: float) -> dict:
    """TTFT and E2E mean / p90 and TPOT of these requests as the client saw them (NaN
    where there are none: a stage all inside the cold cycle of a short replay)."""
    if not len(done):
        return {"ttft_mean": np.nan, "ttft_p90": np.nan, "e2e_mean": np.nan,
                "e2e_p90": np.nan, "tpot": np.nan, "requests": 0}
    ttft = done["ttft_s"].to_numpy() + frontend_s
    e2e = done["e2el_s"].to_numpy() + frontend_s
    return {"ttft_mean": float(ttft.mean()), "ttft_p90": float(np.percentile(ttft, 90)),
            "e2e_mean": float(e2e.mean()), "e2e_p90": float(np.percentile(e2e, 90)),
            "tpot": float((e2e.mean() - ttft.mean()) / (output_len - 1)),
            "requests": int(len(done))}
