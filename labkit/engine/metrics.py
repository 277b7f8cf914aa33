"""Metrics: the numbers the field reports, as tables and a summary.

A replay yields two tables and a summary:

- **requests** — one row per call: arrival, first token, finish, input / cached /
  output tokens, TTFT, TPOT, ITL statistics, E2EL, rank, preemptions;
- **steps** — one row per step per DP rank: tokens scheduled (prefill / decode),
  requests, duration, the rank's compute and communication time, its stall (waiting
  for the slowest rank in lockstep), KV in use (blocks, and persistent / temporary KV
  bytes per GPU);
- **summary** — vLLM / AgentX metrics over the measurement window
  ``[warmup_s, end]``: latency percentiles, *throughput per GPU* (logical tokens —
  input including cached, plus output — of the calls completed in the window, divided
  by the window and by every GPU of the deployment), *interactivity*
  ``1 / P90(E2EL / OSL)`` in tokens/s/user, *TPGS* (tokens the GPUs actually
  processed — prompt tokens computed, recomputation included, plus output tokens — per
  GPU-second: throughput without the cached tokens), the token-weighted prefix-cache
  hit rate, peak KV usage, preemptions — and whether those figures describe steady
  state (`run_health.py`: cold-start share, calls cut off, queue at the end, and a
  `warnings` list).

The steps table is filled by subscribing to `StepsCompleted` events; request rows are
read off the engine's requests when the result is collected.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from numba import njit

from labkit.engine import small_pages
from labkit.engine.events import StepsCompleted
from labkit.engine.itl_stats import ITLSamples
from labkit.engine.request import Status
from labkit.engine.run_health import run_health

STEP_COLUMNS = ["step", "instance", "rank", "start_s", "duration_s", "busy_s", "compute_s",
                "comm_s", "stall_s", "num_prefill_reqs", "num_decode_reqs", "prefill_tokens",
                "decode_tokens", "kv_used_blocks", "kv_usage", "persistent_kv_bytes",
                "temporary_kv_bytes"]


# the steps table's columns as the recorder keeps them: integers (kv_total_blocks, each
# row's rank's, for kv_usage) and floats, one row per step and rank
_INT_COLUMNS = ("step", "instance", "rank", "num_prefill_reqs", "num_decode_reqs",
                "prefill_tokens", "decode_tokens", "kv_used_blocks", "kv_total_blocks")
_FLOAT_COLUMNS = ("start_s", "duration_s", "busy_s", "compute_s", "comm_s", "stall_s",
                  "persistent_kv_bytes", "temporary_kv_bytes")


class StepRecorder:
    """Subscribes to StepsCompleted and builds the steps table.

    A replay emits thousands of small chunks (a single step is one row per rank; a run
    of steps, some hundred rows). Each chunk's rows are written, as it comes, into two
    tables — the integer columns and the float ones, a column's rows side by side — by
    one compiled call (`_write`), into room reserved for a million rows that costs
    memory only as it is written: kept as events (about 100 MB of small arrays per 600 s
    replay) or joined a few hundred at a time, the chunks cost a walk over thousands of
    small arrays, and tables grown by copying cost their memory twice. The table, when
    asked for, gathers the rows sorted by start, then rank."""

    def __init__(self, events, capacity: int = 1 << 20) -> None:
        """`capacity`: rows room is reserved for at first (memory is taken only as rows
        are written, `small_pages.py`; past it the tables grow fourfold)."""
        self._ints = small_pages.zeros((len(_INT_COLUMNS), capacity), np.int64)
        self._floats = small_pages.zeros((len(_FLOAT_COLUMNS), capacity), np.float64)
        self.num_rows = 0
        self.num_events = 0  # StepsCompleted events recorded
        self.subscription = events.subscribe(self._on_steps, StepsCompleted)

    def _on_steps(self, ev: StepsCompleted) -> None:
        ranks = np.array(ev.ranks, dtype=np.int64)
        at = self.num_rows
        end = at + len(ev.step_index) * len(ranks)
        if end > self._ints.shape[1]:
            self._grow(end)
        _write(self._ints, self._floats, at, ev.instance, ranks,
               np.asarray(ev.kv_total_blocks).ravel(), ev.step_index, ev.start, ev.duration,
               _integers(ev.num_prefill_reqs), _integers(ev.num_decode_reqs),
               _integers(ev.prefill_tokens), _integers(ev.decode_tokens),
               _integers(ev.kv_used_blocks), ev.busy, ev.compute, ev.comm, ev.stall,
               ev.persistent_kv_bytes, ev.temporary_kv_bytes)
        self.num_rows = end
        self.num_events += 1

    def _grow(self, rows: int) -> None:
        """New tables with room for `rows` (at least four times as many as now), the
        rows so far copied."""
        size = max(rows, 4 * self._ints.shape[1])
        for name in ("_ints", "_floats"):
            old = getattr(self, name)
            new = small_pages.zeros((old.shape[0], size), old.dtype)
            new[:, : self.num_rows] = old[:, : self.num_rows]
            setattr(self, name, new)

    def frame(self) -> pd.DataFrame:
        """The table: the rows sorted by start, then rank (stable: ties in the order they
        came), gathered into memory of the frame's own (its user may write into it):
        numpy's, which takes huge pages — unlike the recorder's tables, it is written
        through at once (small pages cost a fault per 4 KiB: some 26K, ~60 ms, here)."""
        n = self.num_rows
        ints, floats = self._ints[:, :n], self._floats[:, :n]
        order = np.lexsort((ints[2], floats[0]))
        ints = _gather(ints, order, np.empty(ints.shape, np.int64))
        floats = _gather(floats, order, np.empty(floats.shape, np.float64))
        cols = {c: ints[j] for j, c in enumerate(_INT_COLUMNS)}
        cols.update({c: floats[j] for j, c in enumerate(_FLOAT_COLUMNS)})
        cols["kv_usage"] = cols["kv_used_blocks"] / cols.pop("kv_total_blocks")
        return pd.DataFrame({c: cols[c] for c in STEP_COLUMNS}, copy=False)


def _integers(a: np.ndarray) -> np.ndarray:
    """A count column as integers (the table's int64 holds any of them exactly)."""
    if a.dtype.kind not in "iub":
        raise TypeError(f"StepsCompleted counts must be integers, got {a.dtype}")
    return a


@njit(cache=True)
def _write(ints, floats, at, instance, ranks, kv_total, step_index, start, duration,
           num_prefill_reqs, num_decode_reqs, prefill_tokens, decode_tokens, kv_used,
           busy, compute, comm, stall, persistent, temporary):
    """One StepsCompleted's rows into the tables from row `at` on: step by step, rank by
    rank (the columns in `_INT_COLUMNS` and `_FLOAT_COLUMNS` order)."""
    row = at
    for i in range(len(step_index)):
        for j in range(len(ranks)):
            ints[0, row] = step_index[i]
            ints[1, row] = instance
            ints[2, row] = ranks[j]
            ints[3, row] = num_prefill_reqs[i, j]
            ints[4, row] = num_decode_reqs[i, j]
            ints[5, row] = prefill_tokens[i, j]
            ints[6, row] = decode_tokens[i, j]
            ints[7, row] = kv_used[i, j]
            ints[8, row] = kv_total[j]
            floats[0, row] = start[i]
            floats[1, row] = duration[i]
            floats[2, row] = busy[i, j]
            floats[3, row] = compute[i, j]
            floats[4, row] = comm[i, j]
            floats[5, row] = stall[i, j]
            floats[6, row] = persistent[i, j]
            floats[7, row] = temporary[i, j]
            row += 1


@njit(cache=True)
def _gather(table, order, out):
    """out[:, i] = table[:, order[i]], a row of the table at a time."""
    for j in range(table.shape[0]):
        for i in range(len(order)):
            out[j, i] = table[j, order[i]]
    return out


def request_rows(requests: list, with_tokens: bool = False,
                 itl: ITLSamples | None = None) -> pd.DataFrame:
    """One row per request; `with_tokens` (compute plane) adds `output_token_ids`.
    `itl`: the requests' ITLs, if already read. (Built column by column.)"""
    itl = itl if itl is not None else ITLSamples(requests)
    means, p50s, p90s, highs = itl.all_stats()
    nan = np.nan
    cols = {
        "request_id": [r.request_id for r in requests],
        "session_id": [r.session_id for r in requests],
        "kind": [r.kind for r in requests],
        "parent_id": [r.parent_id for r in requests],
        "rank": [r.rank for r in requests],
        "arrival_s": [r.arrival_s for r in requests],
        "first_scheduled_s": [r.first_scheduled_s for r in requests],
        "first_token_s": [r.first_token_s for r in requests],
        "finish_s": [r.finish_s for r in requests],
        "input_tokens": [r.num_prompt_tokens for r in requests],
        "cached_tokens": [max(r.num_cached_tokens, 0) for r in requests],
        "fetched_tokens": [r.num_fetched_tokens for r in requests],
        "offload_tokens": [r.num_offload_tokens for r in requests],
        "transferred_tokens": [r.num_transferred_tokens for r in requests],
        "computed_prefill_tokens": [r.num_computed_prefill_tokens for r in requests],
        "output_tokens": [r.num_output_tokens for r in requests],
        "ttft_s": [r.first_token_s - r.arrival_s if r.first_token_s is not None else nan
                   for r in requests],
        "tpot_s": [(r.finish_s - r.first_token_s) / (r.num_output_tokens - 1)
                   if r.finish_s is not None and r.num_output_tokens > 1 else nan
                   for r in requests],
        "e2el_s": [r.finish_s - r.arrival_s if r.finish_s is not None else nan
                   for r in requests],
        "itl_mean_s": means,
        "itl_p50_s": p50s,
        "itl_p90_s": p90s,
        "itl_max_s": highs,
        "preemptions": [r.num_preemptions for r in requests],
        "completed": [r.finish_s is not None for r in requests],
    }
    if with_tokens:
        cols["output_token_ids"] = [list(r.output_token_ids) for r in requests]
    return pd.DataFrame(cols)


def _pct(values, q: float) -> float:
    values = np.asarray(values, dtype=float)
    values = values[~np.isnan(values)]
    return float(np.percentile(values, q)) if len(values) else float("nan")


def _pcts(values, qs: tuple[float, ...]) -> list[float]:
    """`_pct` of each q in `qs`, the NaNs dropped and the values partitioned once (each
    percentile is the same order statistics and interpolation as alone: equal bit for
    bit; the ITL samples are a million values and more)."""
    values = np.asarray(values, dtype=float)
    missing = np.isnan(values)
    if missing.any():  # (np.percentile sorts a copy: the values are not written)
        values = values[~missing]
    if not len(values):
        return [float("nan")] * len(qs)
    return [float(p) for p in np.percentile(values, qs)]


def _distinct(column: pd.Series) -> int:
    """`column.nunique()`; for integers in a range not much wider than the column is
    long, by counting the values present (`np.bincount`), which takes no hash table."""
    values = column.to_numpy()
    if values.dtype.kind not in "iu" or not len(values):
        return int(column.nunique())
    low, high = int(values.min()), int(values.max())
    if high - low > 4 * len(values) + 1024:  # a count per value would be mostly empty
        return int(column.nunique())
    return int(np.count_nonzero(np.bincount(values - low)))


def measured_calls(requests: pd.DataFrame, warmup_s: float, end_s: float) -> pd.DataFrame:
    """The calls a summary measures: completed, arrived in the window, finished by its end
    (the rows picked by one mask: each filter copies every column)."""
    if not len(requests):
        return requests
    return requests[requests["completed"].astype(bool).to_numpy()
                    & (requests["arrival_s"] >= warmup_s).to_numpy()
                    & (requests["finish_s"] <= end_s).to_numpy()]


def summarize(requests: pd.DataFrame, steps: pd.DataFrame, itl_samples: np.ndarray, *,
              gpus: int, warmup_s: float, end_s: float, wall_s: float,
              measured: pd.DataFrame | None = None) -> dict:
    """The summary's figures. `measured`: `measured_calls(requests, warmup_s, end_s)`,
    if already taken."""
    window = max(end_s - warmup_s, 1e-12)
    if measured is None:
        measured = measured_calls(requests, warmup_s, end_s)
    admitted = requests[requests["first_scheduled_s"].notna()] if len(requests) else requests
    logical = float((measured["input_tokens"] + measured["output_tokens"]).sum()) \
        if len(measured) else 0.0
    output = float(measured["output_tokens"].sum()) if len(measured) else 0.0
    physical = float((measured["computed_prefill_tokens"] + measured["output_tokens"]).sum()) \
        if len(measured) else 0.0
    ratio = (measured["e2el_s"] / measured["output_tokens"]) if len(measured) else []
    p90_ratio = _pct(ratio, 90)
    input_total = float(admitted["input_tokens"].sum()) if len(admitted) else 0.0
    itl_p50, itl_p90 = _pcts(itl_samples, (50, 90))
    ranks = max(_distinct(steps["rank"]), 1) if len(steps) else 1
    return {
        "gpus": gpus,
        "requests_arrived": int(len(requests)),
        "requests_completed": int(len(measured)),
        "sim_duration_s": float(end_s),
        "window_s": float(window),
        "wall_s": float(wall_s),
        "sim_speed": float(end_s / wall_s) if wall_s > 0 else float("inf"),
        "ttft_mean_s": float(measured["ttft_s"].mean()) if len(measured) else float("nan"),
        "ttft_p50_s": _pct(measured.get("ttft_s", []), 50),
        "ttft_p90_s": _pct(measured.get("ttft_s", []), 90),
        "ttft_p99_s": _pct(measured.get("ttft_s", []), 99),
        "tpot_p50_s": _pct(measured.get("tpot_s", []), 50),
        "tpot_p90_s": _pct(measured.get("tpot_s", []), 90),
        "itl_p50_s": itl_p50,
        "itl_p90_s": itl_p90,
        "e2el_p50_s": _pct(measured.get("e2el_s", []), 50),
        "e2el_p90_s": _pct(measured.get("e2el_s", []), 90),
        "interactivity_p90_tok_s": 1.0 / p90_ratio if p90_ratio > 0 else float("nan"),
        "throughput_tok_s_per_gpu": logical / window / gpus,
        "output_tok_s_per_gpu": output / window / gpus,
        "tpgs": physical / window / gpus,
        "prefix_cache_hit_rate": (float(admitted["cached_tokens"].sum()) / input_total
                                  if input_total else 0.0),
        # the part of it served by the rank's own GPU cache (not fetched from another
        # rank, not loaded from the offload tiers)
        "prefix_cache_local_hit_rate": (
            float((admitted["cached_tokens"] - admitted["fetched_tokens"]
                   - admitted["offload_tokens"]).sum()) / input_total
            if input_total else 0.0),
        "kv_cache_usage_peak": float(steps["kv_usage"].max()) if len(steps) else 0.0,
        "preemptions": int(requests["preemptions"].sum()) if len(requests) else 0,
        "kv_fetched_tokens": int(requests["fetched_tokens"].sum()) if len(requests) else 0,
        "kv_offload_loaded_tokens": (int(requests["offload_tokens"].sum())
                                     if len(requests) else 0),
        "kv_pd_transferred_tokens": (int(requests["transferred_tokens"].sum())
                                     if len(requests) else 0),
        "steps": _distinct(steps["step"]) if len(steps) else 0,
        "stall_s_per_rank_mean": float(steps["stall_s"].sum() / ranks) if len(steps) else 0.0,
        # share of the window a rank spent waiting for the slowest (lockstep), on average
        "stall_share": _stall_share(steps, ranks, warmup_s, end_s),
    }


def _stall_share(steps: pd.DataFrame, ranks: int, start: float, end: float) -> float:
    """The window's stall per rank (`ranks`: how many) and second of window."""
    if not len(steps) or end <= start:
        return 0.0
    start_s = steps["start_s"]
    # the window's stalls alone, as a column (not the whole table's rows filtered)
    stall = steps["stall_s"][(start_s >= start) & (start_s < end)]
    return float(stall.sum() / ranks / (end - start))


@dataclass
class ReplayResult:
    requests: pd.DataFrame
    steps: pd.DataFrame
    summary: dict = field(default_factory=dict)

    def save(self, out_dir: str | os.PathLike, overwrite: bool = False) -> None:
        """Write requests.parquet, steps.parquet and summary.json into out_dir, all
        three or none (`labkit.outputs.OutDir`): refused if out_dir already holds
        results, unless `overwrite`, or while another run writes there."""
        from labkit.outputs import OutDir

        with OutDir(out_dir, overwrite=overwrite, flag="out_dir") as out:
            out.write(self.write_files)

    def write_files(self, folder: str | os.PathLike) -> None:
        """The three files, written into `folder` as they are (see `save`)."""
        from labkit.outputs import strict_json

        for name, frame in (("requests", self.requests), ("steps", self.steps)):
            frame.to_parquet(os.path.join(folder, f"{name}.parquet"), index=False)
        with open(os.path.join(folder, "summary.json"), "w") as f:
            f.write(strict_json(self.summary, indent=2))


def collect_result(engine, *, warmup_s: float, end_s: float, wall_s: float,
                   extra: dict | None = None, sessions: pd.DataFrame | None = None,
                   skipped: list[dict] | None = None, options=None) -> ReplayResult:
    """Tables and summary. `sessions`: the replay's SessionLedger table (default: read
    off the requests); `skipped`: rows of skipped calls (a skip-mode replay, see
    `oversize.py`); `options`: `slo.MetricOptions` (goodput, percentiles, cost)."""
    from labkit.engine.oversize import with_skipped
    from labkit.engine.session_ledger import sessions_from_requests
    from labkit.engine.slo import MetricOptions, service_summary

    # Requests scheduled to arrive after the run ended never existed for it.
    requests = [r for r in engine.requests.values() if r.status is not Status.PENDING]
    samples = ITLSamples(requests)
    table = request_rows(requests, with_tokens=engine.computes, itl=samples)
    steps = engine.step_recorder.frame()
    itl = samples.where([r.arrival_s >= warmup_s for r in requests])
    measured = measured_calls(table, warmup_s, end_s)
    summary = summarize(table, steps, itl, gpus=engine.gpus, warmup_s=warmup_s, end_s=end_s,
                        wall_s=wall_s, measured=measured)
    summary["requests_skipped"] = len(skipped or [])
    summary.update(service_summary(
        measured, itl,
        sessions if sessions is not None else sessions_from_requests(table),
        options or MetricOptions(), window=max(end_s - warmup_s, 1e-12), gpus=engine.gpus,
        warmup_s=warmup_s, end_s=end_s))
    if skipped is not None:
        table = with_skipped(table, skipped)
    summary.update({"model": engine.model.name, "layout": engine.layout.text,
                    "hardware": engine.hardware.name, "backend": engine.backend,
                    "router": engine.config.router, "block_size": engine.block_size,
                    "num_gpu_blocks_per_rank": engine.num_blocks_per_rank,
                    **engine.extra_summary(),
                    "warmup_s": warmup_s, **(extra or {})})
    extra = extra or {}
    summary.update(run_health(table, summary, warmup_s=warmup_s, end_s=end_s,
                              closed_loop=extra.get("concurrency") is not None,
                              start_part_way=bool(extra.get("start_part_way"))))
    return ReplayResult(table, steps, summary)
