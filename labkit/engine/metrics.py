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

from labkit.engine.events import StepsCompleted
from labkit.engine.itl_stats import ITLSamples
from labkit.engine.request import Status
from labkit.engine.run_health import run_health

STEP_COLUMNS = ["step", "instance", "rank", "start_s", "duration_s", "busy_s", "compute_s",
                "comm_s", "stall_s", "num_prefill_reqs", "num_decode_reqs", "prefill_tokens",
                "decode_tokens", "kv_used_blocks", "kv_usage", "persistent_kv_bytes",
                "temporary_kv_bytes"]


class StepRecorder:
    """Subscribes to StepsCompleted and builds the steps table.

    A replay emits thousands of small chunks (a single step is one row per rank). Each
    chunk is kept as it comes; every `block_events` chunks they are joined into one
    block of row columns, step by step and rank by rank, in the order they came, and the
    events are let go: kept to the end, a 600 s replay's 13.5K events hold about 100 MB
    of small arrays, which the collector walks and the table gathers piece by piece at
    the end. The table, when asked for, joins the few blocks and sorts their rows by
    start, then rank."""

    # per-rank columns of the event, (steps, ranks) arrays, as the table names them
    _PER_RANK = {"busy_s": "busy", "compute_s": "compute", "comm_s": "comm",
                 "stall_s": "stall", "num_prefill_reqs": "num_prefill_reqs",
                 "num_decode_reqs": "num_decode_reqs", "prefill_tokens": "prefill_tokens",
                 "decode_tokens": "decode_tokens", "kv_used_blocks": "kv_used_blocks",
                 "persistent_kv_bytes": "persistent_kv_bytes",
                 "temporary_kv_bytes": "temporary_kv_bytes"}

    def __init__(self, events, block_events: int = 512) -> None:
        self.block_events = block_events
        self._chunks: list[tuple] = []  # chunks not yet in a block: (event, ranks)
        self._blocks: list[dict] = []  # row columns (and kv_total_blocks) of each block
        self.num_events = 0  # StepsCompleted events recorded
        self.subscription = events.subscribe(self._on_steps, StepsCompleted)

    def _on_steps(self, ev: StepsCompleted) -> None:
        # the event's arrays are never written after it is emitted; the ranks are
        # copied, as they are the instance's own list
        self._chunks.append((ev, tuple(ev.ranks)))
        self.num_events += 1
        if len(self._chunks) >= self.block_events:
            self._join_chunks()

    def _join_chunks(self) -> None:
        if self._chunks:
            self._blocks.append(_rows(self._chunks))
            self._chunks = []

    def frame(self) -> pd.DataFrame:
        self._join_chunks()
        if not self._blocks:
            return pd.DataFrame({c: pd.Series(dtype=float) for c in STEP_COLUMNS})
        # Each column's blocks are joined into a scratch buffer (one per dtype, reused),
        # then put in order into its own array, which the frame takes as it is: a
        # replay's table is hundreds of MB, and fresh memory for every intermediate is
        # a cost.
        scratch: dict = {}

        def joined(c: str) -> np.ndarray:
            parts = [b[c] for b in self._blocks]
            if len(parts) == 1:
                return parts[0]
            kind = np.result_type(*parts)  # as np.concatenate(parts) would make it
            size = sum(len(p) for p in parts)
            if kind not in scratch or len(scratch[kind]) != size:
                scratch[kind] = np.empty(size, kind)
            return np.concatenate(parts, out=scratch[kind])

        # by start, then rank; a stable sort, so ties keep the order they came in
        order = np.lexsort((joined("rank").copy(), joined("start_s")))
        cols = {c: joined(c)[order] for c in self._blocks[0]}
        cols["kv_usage"] = cols["kv_used_blocks"] / cols.pop("kv_total_blocks")
        return pd.DataFrame({c: cols[c] for c in STEP_COLUMNS}, copy=False)


_PER_STEP = {"step": "step_index", "start_s": "start", "duration_s": "duration"}
_AS_FLOAT = ("persistent_kv_bytes", "temporary_kv_bytes")  # float columns whatever comes


def _rows(chunks: list[tuple]) -> dict:
    """The table's columns (and each row's kv_total_blocks) of StepsCompleted `chunks`,
    (event, ranks), unsorted: chunk by chunk, step by step, rank by rank. A column's
    dtype is the one numpy gives its pieces joined."""
    events = [ev for ev, _ in chunks]
    steps = np.array([len(ev.step_index) for ev in events], dtype=np.int64)
    width = np.array([len(r) for _, r in chunks], dtype=np.int64)
    rows = steps * width  # rows of each chunk
    same = int(width[0]) if (width == width[0]).all() else 0  # 0: widths differ
    per_step = np.repeat(width, steps)  # rows of each step
    # each row's entry in the chunks' ranks, all put one after another: its chunk's
    # first, plus its place among the chunk's ranks
    rank_idx = np.repeat(np.cumsum(width) - width, rows)
    if same != 1:
        pos = np.arange(int(rows.sum())) - np.repeat(np.cumsum(rows) - rows, rows)
        rank_idx += pos % np.repeat(width, rows)
    all_ranks = np.array([rank for _, r in chunks for rank in r], dtype=np.int64)
    totals = np.concatenate([np.asarray(ev.kv_total_blocks).ravel() for ev in events])
    cols = {"instance": np.repeat(np.array([ev.instance for ev in events], dtype=np.int64),
                                  rows),
            "rank": all_ranks[rank_idx], "kv_total_blocks": totals[rank_idx]}
    for c, f in _PER_STEP.items():  # (steps,): the same in each of the step's rows
        col = np.concatenate([getattr(ev, f) for ev in events])
        cols[c] = col if same == 1 else np.repeat(col, per_step)
    for c, f in StepRecorder._PER_RANK.items():  # (steps, ranks): rows as they are laid
        parts = [getattr(ev, f) for ev in events]
        col = np.concatenate(parts).reshape(-1) if same else \
            np.concatenate([p.reshape(-1) for p in parts])
        cols[c] = col.astype(float, copy=False) if c in _AS_FLOAT else col
    return cols


def request_rows(requests: list, with_tokens: bool = False,
                 itl: ITLSamples | None = None) -> pd.DataFrame:
    """One row per request; `with_tokens` (compute plane) adds `output_token_ids`.
    `itl`: the requests' ITLs, if already read."""
    itl = itl if itl is not None else ITLSamples(requests)
    rows = []
    for i, r in enumerate(requests):
        itl_mean, p50, p90, itl_max = itl.stats(i)
        done = r.finish_s is not None
        ttft = r.first_token_s - r.arrival_s if r.first_token_s is not None else np.nan
        e2el = r.finish_s - r.arrival_s if done else np.nan
        tpot = ((r.finish_s - r.first_token_s) / (r.num_output_tokens - 1)
                if done and r.num_output_tokens > 1 else np.nan)
        rows.append({
            "request_id": r.request_id, "session_id": r.session_id, "kind": r.kind,
            "parent_id": r.parent_id, "rank": r.rank, "arrival_s": r.arrival_s,
            "first_scheduled_s": r.first_scheduled_s, "first_token_s": r.first_token_s,
            "finish_s": r.finish_s, "input_tokens": r.num_prompt_tokens,
            "cached_tokens": max(r.num_cached_tokens, 0),
            "fetched_tokens": r.num_fetched_tokens,
            "offload_tokens": r.num_offload_tokens,
            "transferred_tokens": r.num_transferred_tokens,
            "computed_prefill_tokens": r.num_computed_prefill_tokens,
            "output_tokens": r.num_output_tokens, "ttft_s": ttft, "tpot_s": tpot,
            "e2el_s": e2el,
            "itl_mean_s": itl_mean, "itl_p50_s": p50, "itl_p90_s": p90,
            "itl_max_s": itl_max,
            "preemptions": r.num_preemptions, "completed": done,
        })
        if with_tokens:
            rows[-1]["output_token_ids"] = list(r.output_token_ids)
    return pd.DataFrame(rows)


def _pct(values, q: float) -> float:
    values = np.asarray(values, dtype=float)
    values = values[~np.isnan(values)]
    return float(np.percentile(values, q)) if len(values) else float("nan")


def measured_calls(requests: pd.DataFrame, warmup_s: float, end_s: float) -> pd.DataFrame:
    """The calls a summary measures: completed, arrived in the window, finished by its end."""
    done = requests[requests["completed"].astype(bool)] if len(requests) else requests
    return done[(done["arrival_s"] >= warmup_s) & (done["finish_s"] <= end_s)] \
        if len(done) else done


def summarize(requests: pd.DataFrame, steps: pd.DataFrame, itl_samples: np.ndarray, *,
              gpus: int, warmup_s: float, end_s: float, wall_s: float) -> dict:
    window = max(end_s - warmup_s, 1e-12)
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
        "itl_p50_s": _pct(itl_samples, 50),
        "itl_p90_s": _pct(itl_samples, 90),
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
        "steps": int(steps["step"].nunique()) if len(steps) else 0,
        "stall_s_per_rank_mean": float(steps["stall_s"].sum() / max(steps["rank"].nunique(), 1))
        if len(steps) else 0.0,
        # share of the window a rank spent waiting for the slowest (lockstep), on average
        "stall_share": _stall_share(steps, warmup_s, end_s),
    }


def _stall_share(steps: pd.DataFrame, start: float, end: float) -> float:
    if not len(steps) or end <= start:
        return 0.0
    window = steps[(steps["start_s"] >= start) & (steps["start_s"] < end)]
    ranks = max(steps["rank"].nunique(), 1)
    return float(window["stall_s"].sum() / ranks / (end - start))


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
    summary = summarize(table, steps, itl, gpus=engine.gpus, warmup_s=warmup_s, end_s=end_s,
                        wall_s=wall_s)
    summary["requests_skipped"] = len(skipped or [])
    summary.update(service_summary(
        measured_calls(table, warmup_s, end_s), itl,
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
