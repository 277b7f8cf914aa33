"""Service-level metrics: goodput, SLO attainment, task completion, percentiles, cost.

These answer "does this deployment serve my users well enough, and at what price?".
All are computed over the calls the summary measures (arrived at or after
``warmup_s``, finished by the end of the run; see ``metrics.py``).

**Goodput and SLO attainment** (DistServe; ``vllm bench serve --goodput``). A call is
*good* when it meets every SLO given: TTFT <= ``ttft``, TPOT <= ``tpot``, E2EL <=
``e2el`` (seconds here; vLLM's flag takes milliseconds). As in vLLM, a call that
generated a single token has TPOT 0 for this test. ``goodput_req_s`` is good calls
per second of the window (and per GPU); ``slo_attainment`` the share of measured
calls that are good; ``slo_<metric>_attainment`` the share meeting that one SLO.

**Session completion** (``session_completion_*_s``): the time an agent task takes
from its first call's arrival to its last call's finish, over whole tasks that
started and finished in the window (``session_ledger.py``).

**Chosen percentiles** (``percentiles=(50, 90, 99)``, vLLM's
``--metric-percentiles``): ``<metric>_p<q>_s`` for TTFT, TPOT, ITL, E2EL and session
completion, in addition to the summary's fixed ones (same definition, so a key both
produce has one value).

**Cost** (``gpu_hour_usd``): every GPU of the deployment is paid for the whole
window: ``cost_usd = gpus * window / 3600 * gpu_hour_usd``, divided by the millions
of tokens served -- logical tokens (input including cached, plus output; the
tokens of ``throughput_tok_s_per_gpu``) and output tokens.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from labkit.engine.metrics import _pct
from labkit.errors import ConfigError

SLO_METRICS = ("ttft", "tpot", "e2el")
DEFAULT_SESSION_PERCENTILES = (50.0, 90.0)


@dataclass(slots=True)
class MetricOptions:
    slo: dict[str, float] = field(default_factory=dict)   # metric -> seconds
    percentiles: tuple[float, ...] = ()
    gpu_hour_usd: float | None = None


def metric_options(slo: str | dict | None = None,
                   percentiles: str | Iterable[float] | None = None,
                   gpu_hour_usd: float | None = None) -> MetricOptions:
    """Checked options from ``"ttft=2,tpot=0.05"`` / a dict, ``"50,90,99"`` / numbers,
    and a price (ConfigError naming the knob otherwise)."""
    if isinstance(slo, str):
        slo = _parse_pairs(slo)
    slo = dict(slo or {})
    for name, bound in slo.items():
        if name not in SLO_METRICS:
            raise ConfigError(f"slo: unknown metric {name!r}; allowed: {', '.join(SLO_METRICS)}")
        if not (isinstance(bound, (int, float)) and math.isfinite(bound) and bound > 0):
            raise ConfigError(f"slo: {name}={bound!r} must be a number of seconds > 0")
    if isinstance(percentiles, str):
        percentiles = _parse_numbers(percentiles, "percentiles")
    percentiles = tuple(float(q) for q in (percentiles or ()))
    if any(not 0 <= q <= 100 for q in percentiles):
        raise ConfigError(f"percentiles {percentiles} must be in [0, 100]")
    if gpu_hour_usd is not None and not (math.isfinite(gpu_hour_usd) and gpu_hour_usd >= 0):
        raise ConfigError(f"gpu_hour_usd={gpu_hour_usd} must be a finite price >= 0")
    return MetricOptions({k: float(v) for k, v in slo.items()}, percentiles, gpu_hour_usd)


def _parse_pairs(text: str) -> dict[str, float]:
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise ConfigError(f"slo: {part!r} is not METRIC=SECONDS (e.g. "
                              f"ttft=2,tpot=0.05)") from None
    return out


def _parse_numbers(text: str, knob: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{knob}: {text!r} is not a comma-separated list of numbers") \
            from None


def percentile_key(metric: str, q: float) -> str:
    """``ttft_p99_s``, ``itl_p99.9_s`` (vLLM writes p99, p99.9 the same way)."""
    return f"{metric}_p{int(q) if q == int(q) else q}_s"


def service_summary(measured: pd.DataFrame, itl: np.ndarray, sessions: pd.DataFrame,
                    options: MetricOptions, *, window: float, gpus: int, warmup_s: float,
                    end_s: float) -> dict:
    """The summary entries of this module (see the module docstring)."""
    out = _session_entries(sessions, options.percentiles, warmup_s, end_s)
    samples = {"ttft": measured.get("ttft_s", []), "tpot": measured.get("tpot_s", []),
               "itl": itl, "e2el": measured.get("e2el_s", [])}
    for q in options.percentiles:
        for metric, values in samples.items():
            out[percentile_key(metric, q)] = _pct(values, q)
    if options.slo:
        out.update(_goodput(measured, options.slo, window, gpus))
    if options.gpu_hour_usd is not None:
        cost = gpus * window / 3600.0 * options.gpu_hour_usd
        logical = float((measured["input_tokens"] + measured["output_tokens"]).sum()) \
            if len(measured) else 0.0
        output = float(measured["output_tokens"].sum()) if len(measured) else 0.0
        out.update({"cost_usd": cost,
                    "usd_per_m_tokens": cost / (logical / 1e6) if logical else math.inf,
                    "usd_per_m_output_tokens": cost / (output / 1e6) if output else math.inf})
    return out


def _goodput(measured: pd.DataFrame, slo: dict[str, float], window: float,
             gpus: int) -> dict:
    n = len(measured)
    good = np.ones(n, dtype=bool)
    out = {}
    for metric, bound in slo.items():
        values = measured[f"{metric}_s"].to_numpy(dtype=float) if n else np.empty(0)
        if metric == "tpot":  # a one-token call has no decode: TPOT 0 (vLLM)
            values = np.where(measured["output_tokens"].to_numpy() <= 1, 0.0, values)
        meets = values <= bound  # NaN (no value) fails
        good &= meets
        out[f"slo_{metric}_attainment"] = float(meets.mean()) if n else float("nan")
    out.update({"goodput_req_s": float(good.sum()) / window,
                "goodput_req_s_per_gpu": float(good.sum()) / window / gpus,
                "slo_attainment": float(good.mean()) if n else float("nan")})
    return out


def _session_entries(sessions: pd.DataFrame, percentiles: tuple[float, ...],
                     warmup_s: float, end_s: float) -> dict:
    whole = sessions[sessions["finished"] & ~sessions["part_way"]
                     & (sessions["skipped_calls"] == 0) & (sessions["start_s"] >= warmup_s)
                     & (sessions["end_s"] <= end_s)] if len(sessions) else sessions
    times = whole["completion_s"].to_numpy(dtype=float) if len(whole) else np.empty(0)
    out = {"sessions_completed": int(len(times)),
           "session_completion_mean_s": float(times.mean()) if len(times) else float("nan")}
    for q in dict.fromkeys(DEFAULT_SESSION_PERCENTILES + percentiles):
        out[percentile_key("session_completion", q)] = _pct(times, q)
    return out
