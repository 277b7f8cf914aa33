"""Requests that can never run: refuse the replay, or skip them as vLLM would.

A request longer than ``max_model_len``, or needing more KV blocks than a DP rank
holds, can never be scheduled. ``on_oversize="error"`` (the default) refuses the
whole replay before anything runs, naming the first such request -- a deployment
that cannot serve the trace is usually a mistake. ``on_oversize="skip"`` does what
vLLM does with such a request: rejects it at once and serves the rest; real traces
(a 2-hour production log, a few odd 1M-token prompts) need that.

What a skipped call does to its session. Its output never exists, and every later
call of its thread re-sends that output, so:

* a call whose **parent was skipped is skipped too** -- a main call takes the rest of
  the task down with it (the task failed), a subagent call the rest of that
  subagent;
* a main call does **not** wait for skipped subagent calls: a failed subagent comes
  back to the agent as a tool error, and the agent carries on;
* in an **open loop** a call with its own ``timestamp`` arrives whatever happened to
  its parent (arrivals do not depend on completions there), so only the oversized
  calls themselves are skipped.

A session that loses calls ends when its remaining calls finish (in a closed loop
the next session then starts, keeping the concurrency) and is not a whole task for
the session-completion metrics. Skipped calls are counted in the summary
(``requests_skipped``) and listed in requests.parquet with ``skipped`` True and a
``skip_reason``; with ``on_oversize="skip"`` every row has those two columns.
"""
from __future__ import annotations

import pandas as pd

from labkit.errors import ConfigError, unknown_choice

ON_OVERSIZE = ("error", "skip")


def oversized_requests(engine, trace, on_oversize: str) -> dict[str, str]:
    """Trace request id -> why it can never run; raises the first one's ConfigError
    when ``on_oversize`` is "error"."""
    if on_oversize not in ON_OVERSIZE:
        raise unknown_choice("on_oversize", on_oversize, ON_OVERSIZE)
    if _all_fit(engine, trace.requests):
        return {}
    found = {}
    for tr in trace.requests:
        try:
            engine.check_fits(tr.request_id, tr.input_length, tr.output_length)
        except ConfigError as err:
            if on_oversize == "error":
                raise
            found[tr.request_id] = str(err)
    if found and all(plan_skips(s, found, open_loop=False).keys() >= {r.request_id for r in s}
                     for s in trace.sessions()):
        raise ConfigError(f"every session of the trace starts with a call that can never "
                          f"run (e.g. {next(iter(found.values()))}); nothing to replay")
    return found


def _all_fit(engine, requests) -> bool:
    """Do all requests fit, by one check? What `check_fits` asks grows with the prompt
    (can it be prefilled) and with prompt plus output (max_model_len, KV blocks), so a
    request with the longest prompt and the longest total of all fits only if every
    one does (each total is at least its prompt). False: look one by one."""
    if not requests:
        return True
    longest = max(tr.input_length for tr in requests)
    total = max(tr.input_length + tr.output_length for tr in requests)
    try:
        engine.check_fits("(longest)", longest, total - longest)
    except ConfigError:
        return False
    return True


def plan_skips(calls: list, oversized: dict[str, str], open_loop: bool) -> dict[str, str]:
    """Which of a session's ``calls`` (parents first) are skipped, and why."""
    skipped: dict[str, str] = {}
    for tr in calls:
        if tr.request_id in oversized:
            skipped[tr.request_id] = f"oversize: {oversized[tr.request_id]}"
        elif tr.parent_id in skipped and not (open_loop and tr.timestamp is not None):
            skipped[tr.request_id] = f"after skipped {tr.parent_id}"
    return skipped


def skipped_row(request_id: str, session_id: str, parent_id: str | None, tr,
                reason: str) -> dict:
    """The requests-table row of a skipped call: what it asked for, no timings."""
    return {"request_id": request_id, "session_id": session_id, "kind": tr.kind,
            "parent_id": parent_id, "input_tokens": tr.input_length, "output_tokens": 0,
            "completed": False, "skipped": True, "skip_reason": reason}


def with_skipped(table: pd.DataFrame, rows: list[dict]) -> pd.DataFrame:
    """The requests table of a skip-mode run: served calls, then skipped ones."""
    table = table.assign(skipped=False, skip_reason=None)
    if not rows:
        return table
    return pd.concat([table, pd.DataFrame(rows)], ignore_index=True)
