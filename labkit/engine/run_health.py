"""Run health: is a replay's summary about steady state, or about its edges?

A summary's percentiles and throughput are only as good as the calls behind them.
Three things make them misleading, and each can be measured from the requests table:

- **cold start** — in a fresh engine, a session's first call in the run finds none of
  its context cached: it prefills all of it. Started at turn one that is a short
  prompt; started part-way (AgentX's `start_part_way`) it is the session's whole
  context, often hundreds of thousands of tokens, and such prefills can fill the
  first minutes. `cold_start_prefill_share` is the share of the prompt tokens computed
  for calls arriving in the window that belong to those first calls (closed loop
  only: open-loop traces have no sessions to start). Above `COLD_START_SHARE` the
  summary warns.
- **calls cut off at the end** — a call that arrived in the window but had not
  finished when it ended counts in no latency and no throughput, so the longest calls
  are the likeliest to be missing. `unfinished_share` is their share of the calls
  arriving in the window; above `UNFINISHED_SHARE` the summary warns (the deployment
  is overloaded, or the window is short next to the calls' E2E latency).
- **a growing queue** — calls still waiting for admission at the end
  (`queued_at_end`, the oldest for `queue_wait_max_s`). Each has already waited
  longer than its TTFT will be; when those that waited longer than the reported TTFT
  p90 would be more than a tenth of all calls, that p90 is not the p90 users saw: the
  deployment cannot keep up (overload).

Also: fewer than `MIN_CALLS` measured calls make a P90 a statement about two calls.

`run_health(...)` returns these fields and a `warnings` list of sentences saying
what to do; `labkit replay` prints the warnings.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

COLD_START_SHARE = 0.5  # warn when session openings computed more than this share
UNFINISHED_SHARE = 0.25  # warn when more than this share of window calls never finished
MIN_CALLS = 20  # warn when fewer calls than this were measured


def run_health(requests: pd.DataFrame, summary: dict, *, warmup_s: float, end_s: float,
               closed_loop: bool, start_part_way: bool = False) -> dict:
    """Health fields and warnings of one run (see the module docstring). Skipped calls
    (a skip-mode run's rows with `skipped` True) were never queued nor cut off: left out."""
    if "skipped" in requests:
        requests = requests[~requests["skipped"].astype(bool)]
    window = requests[requests["arrival_s"] >= warmup_s] if len(requests) else requests
    done = window["completed"].astype(bool) if len(window) else pd.Series(dtype=bool)
    unfinished = int((~done).sum())
    queued = requests[requests["first_scheduled_s"].isna()] if len(requests) else requests
    waits = (end_s - queued["arrival_s"]).to_numpy(dtype=float) if len(queued) else []
    p90 = summary.get("ttft_p90_s", math.nan)
    out = {
        "cold_start_prefill_share": _cold_share(requests, window) if closed_loop else None,
        "unfinished_share": unfinished / len(window) if len(window) else 0.0,
        "queued_at_end": int(len(queued)),
        "queue_wait_max_s": float(max(waits, default=0.0)),
    }
    # queued calls whose TTFT will exceed the reported p90 (all of them if none was measured)
    beyond = sum(1 for w in waits if not w <= p90)
    out["warnings"] = _warnings(out, summary, unfinished, len(window), beyond, start_part_way)
    return out


def _cold_share(requests: pd.DataFrame, window: pd.DataFrame) -> float:
    """Share of the window's computed prompt tokens spent on sessions' first calls in
    the run: calls whose parent is not one of the run's calls."""
    if not len(window):
        return 0.0
    known = set(requests["request_id"].tolist())
    parents = window["parent_id"]
    # a set's look-ups, one per call (pandas' `isin` on a string column makes an Arrow
    # scalar of every id first); a missing parent opens a session too
    opening = np.array([p not in known for p in parents.tolist()], dtype=bool) \
        | parents.isna().to_numpy()
    tokens = window["computed_prefill_tokens"].to_numpy(dtype=float)
    total = tokens.sum()
    return float(tokens[opening].sum() / total) if total else 0.0


def _warnings(h: dict, summary: dict, unfinished: int, arrived: int, beyond: int,
              part_way: bool) -> list[str]:
    out = []
    cold = h["cold_start_prefill_share"]
    if cold is not None and cold > COLD_START_SHARE:
        how = ("sessions started part-way prefill their whole context: start them at turn "
               "one (start_part_way off) or raise warmup_s past those prefills"
               if part_way else "raise warmup_s or duration_s")
        out.append(f"cold start: {cold:.0%} of the prompt tokens computed for calls in the "
                   f"window opened a session in this run (contexts the cache had not seen); {how}")
    if arrived and h["unfinished_share"] > UNFINISHED_SHARE:
        out.append(f"{unfinished} of {arrived} calls that arrived in the window "
                   f"({h['unfinished_share']:.0%}) had not finished at its end and are in no "
                   f"latency or throughput figure: the deployment is overloaded or the run is "
                   f"short next to the calls' latency; run longer or with less load")
    completed = summary.get("requests_completed", 0)
    if beyond and beyond > 0.1 * (completed + beyond):
        out.append(f"overload: {h['queued_at_end']} calls were still waiting for admission at "
                   f"the end, the oldest for {h['queue_wait_max_s']:.1f} s; {beyond} of them had "
                   f"already waited longer than the reported TTFT p90 "
                   f"({summary.get('ttft_p90_s', math.nan):.3g} s), which leaves them out")
    if completed < MIN_CALLS:
        out.append(f"only {completed} calls completed in the window: its percentiles rest on "
                   f"few calls; run longer or with more sessions")
    return out


def format_warnings(warnings: list[str]) -> str:
    """One `warning:` line per entry, for a terminal."""
    return "\n".join(f"warning: {w}" for w in warnings)
