"""The deployment planner: which way of serving this model on N GPUs meets my SLOs on
this traffic, and at what throughput per GPU?

The planner answers by simulation. It lists the **search space** — every layout the
model accepts within N GPUs (the dashboard's legal choices, `layout_choices.py`:
TP, DP, DEP, DCP, PCP), every prefill/decode split of two such layouts whose groups
fit in N GPUs together (`disagg.PDEngine`), times a few scheduler knobs
(``max_num_batched_tokens``, ``long_prefill_token_threshold``) and closed-loop
concurrencies — and replays the trace once per point, in parallel on the sweep
executor (`executors.py`: local processes or Ray tasks). Each replay is a plain Python
call (`evaluate`), not a notebook.

From the summaries it reads the service metrics (`engine/slo.py`):

- a point **meets the SLOs** when its ``slo_attainment`` (the share of measured calls
  meeting every SLO, as ``vllm bench serve --goodput``) is at least
  ``min_attainment``;
- the **best** points are those, ranked by ``goodput_req_s_per_gpu`` (good calls per
  second per GPU: what one GPU earns while serving well), then
  ``throughput_tok_s_per_gpu``, then fewer GPUs, then search order;
- the **frontier** is the throughput-per-GPU vs interactivity Pareto frontier of every
  point that ran (`frontier.pareto_mask`), the AgentX picture of a deployment's
  trade-off;
- with a GPU-hour price (``gpu_hour_usd``) each point also gets its cost per million
  tokens served (``usd_per_m_tokens``, ``usd_per_m_output_tokens``: every GPU paid for
  the measured window, `engine/slo.py`) — at one price per GPU the cheapest per token
  is the point with the most throughput per GPU.

A point the engine refuses (a request that cannot fit, a decode layout that splits
prompts, ...) is kept in the table with ``status = "failed"`` and the reason
(``oversize``: refused for a call no rank can hold, which ``on_oversize="skip"``
would serve around).
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import sys
from dataclasses import asdict, dataclass

import pandas as pd

from labkit import checks
from labkit.errors import ConfigError, OversizeError
from labkit.experiments.executors import check_executor, run_tasks
from labkit.experiments.frontier import X_METRIC, Y_METRIC, pareto_mask
from labkit.experiments.rate_matching import _warmup, check_run_length

RANK_BY = ("goodput_req_s_per_gpu", "throughput_tok_s_per_gpu")
METRICS = ("goodput_req_s_per_gpu", "goodput_req_s", "slo_attainment",
           "throughput_tok_s_per_gpu", "output_tok_s_per_gpu", "interactivity_p90_tok_s",
           "ttft_p90_s", "tpot_p90_s", "e2el_p90_s", "requests_completed",
           "usd_per_m_tokens", "usd_per_m_output_tokens")


@dataclass(slots=True, frozen=True)
class Deployment:
    """One point of the search space. Aggregated: `layout` serves everything.
    Disaggregated: `num_prefill` groups of `prefill_layout`, `num_decode` of `layout`."""
    layout: str
    gpus: int
    prefill_layout: str | None = None
    num_prefill: int = 0
    num_decode: int = 0
    max_num_batched_tokens: int | None = None
    long_prefill_token_threshold: int | None = None
    concurrency: int = 8

    @property
    def name(self) -> str:
        if self.prefill_layout is None:
            return self.layout
        return f"{self.num_prefill}x{self.prefill_layout}:{self.num_decode}x{self.layout}"

    def knobs(self) -> dict:
        return {k: v for k in ("max_num_batched_tokens", "long_prefill_token_threshold")
                if (v := getattr(self, k)) is not None}


# -------------------------------------------------------------------- search space
def legal_layouts(model, hardware, gpus: int, only=None,
                  knobs: dict | None = None) -> list[tuple[str, int]]:
    """(layout, its GPUs) the model accepts within `gpus`, fewest GPUs first; `only`
    restricts them to the given layout strings (each must be legal)."""
    from labkit.specs import Layout
    from labkit.widgets.layout_choices import options

    table = options(model, hardware, **(knobs or {}))
    legal = {text: Layout.parse(text).gpus for by in table.values() for text in by.values()}
    if only is not None:
        for text in only:
            if text not in legal:
                raise ConfigError(f"--layouts {text!r} is not a legal layout of {model} on "
                                  f"{hardware}; legal: {', '.join(legal)}")
        legal = {text: legal[text] for text in only}
    fit = [(text, n) for text, n in legal.items() if n <= gpus]
    return sorted(fit, key=lambda item: (item[1], item[0]))


def search_space(model, hardware, gpus: int, concurrency=(8,), layouts=None,
                 disaggregated: bool = True, max_num_batched_tokens=(None,),
                 long_prefill_token_threshold=(None,), max_groups: int = 2,
                 pd_layouts=None, knobs: dict | None = None) -> list[Deployment]:
    """Every point the planner simulates, in a fixed order. `pd_layouts`: the layouts
    P/D roles may take (default: those of `layouts`)."""
    from labkit.engine.disagg import check_decode_layout
    from labkit.specs import Layout

    checks.integer("gpus", gpus, low=1)
    checks.integer("max_groups", max_groups, low=1)
    legal = legal_layouts(model, hardware, gpus, layouts, knobs)
    shapes = [dict(layout=text, gpus=n) for text, n in legal]
    roles = legal if pd_layouts is None else legal_layouts(model, hardware, gpus, pd_layouts,
                                                           knobs)
    if disaggregated:
        for (p_text, p_gpus), (d_text, d_gpus) in itertools.product(roles, roles):
            try:
                check_decode_layout(Layout.parse(d_text), "decode")
            except ConfigError:
                continue  # PCP splits prompts: a prefill layout only
            for p, d in itertools.product(range(1, max_groups + 1), repeat=2):
                if p * p_gpus + d * d_gpus <= gpus:
                    shapes.append(dict(layout=d_text, gpus=p * p_gpus + d * d_gpus,
                                       prefill_layout=p_text, num_prefill=p, num_decode=d))
    return [Deployment(**shape, max_num_batched_tokens=b, long_prefill_token_threshold=t,
                       concurrency=c)
            for shape in shapes for b in max_num_batched_tokens
            for t in long_prefill_token_threshold for c in concurrency]


# ------------------------------------------------------------------ one point
def evaluate(point: dict, trace, model, hardware, duration_s: float, warmup_s: float,
             slo, on_oversize: str = "error", knobs: dict | None = None,
             gpu_hour_usd: float | None = None) -> dict:
    """Replay `trace` on one deployment (a worker's task); its row of metrics.
    `trace`: a Trace, or a path (loaded once per worker process); `knobs`: engine
    knobs every deployment shares (e.g. max_model_len); `gpu_hour_usd`: a price, for
    the cost columns (NaN without one)."""
    from labkit.engine import Engine
    from labkit.engine.disagg import PDEngine

    d = Deployment(**point)
    if isinstance(trace, (str, os.PathLike)):
        trace = _load(os.fspath(trace))
    row = {"config": d.name, **asdict(d), "status": "ok", "error": None, "oversize": False}
    knobs = {**(knobs or {}), **d.knobs()}
    try:
        if d.prefill_layout is None:
            engine = Engine(model, d.layout, hardware, **knobs)
        else:
            engine = PDEngine(model, d.prefill_layout, d.layout, hardware, d.num_prefill,
                              d.num_decode, **knobs)
        summary = engine.replay(trace, concurrency=d.concurrency, duration_s=duration_s,
                                warmup_s=warmup_s, slo=slo, on_oversize=on_oversize,
                                gpu_hour_usd=gpu_hour_usd).summary
    except ConfigError as err:
        row.update(status="failed", error=str(err), oversize=isinstance(err, OversizeError))
        summary = {}
    row.update({m: _number(summary.get(m)) for m in METRICS})
    return row


def check_model_len(trace, model, knobs: dict | None = None) -> None:
    """Refuse, before anything runs, a trace with a call longer than max_model_len:
    every point would be refused for it (what else can refuse a call, its KV against a
    rank's, depends on the layout: each point checks that)."""
    from labkit.engine.engine import check_model_len as check_call
    from labkit.specs import get_model

    spec = get_model(model)
    limit = (knobs or {}).get("max_model_len") or spec.max_model_len
    trace = _load(os.fspath(trace)) if isinstance(trace, (str, os.PathLike)) else trace
    for tr in trace.requests:
        check_call(tr.request_id, tr.input_length, tr.output_length, limit, spec.name,
                   ", for every configuration: raise it (--max-model-len) or skip such "
                   "calls (--on-oversize skip)")


@functools.lru_cache(maxsize=4)
def _load(path: str):
    from labkit.traces import load_trace

    return load_trace(path)


def _number(value) -> float:
    return math.nan if value is None else float(value)


# ------------------------------------------------------------------ the search
@dataclass(slots=True)
class PlanResult:
    results: pd.DataFrame    # one row per point, in search order: meets_slo, rank, pareto
    best: pd.DataFrame       # the points meeting the SLOs, best first
    frontier: pd.DataFrame   # the Pareto points, by interactivity


def plan(trace, model, hardware="h200", gpus: int = 8, slo="ttft=2,tpot=0.05",
         concurrency=(8,), duration_s: float = 60.0, warmup_s: float | None = None,
         layouts=None, disaggregated: bool = True, max_num_batched_tokens=(None,),
         long_prefill_token_threshold=(None,), max_groups: int = 2, pd_layouts=None,
         min_attainment: float = 0.9, executor: str = "local", jobs: int = 1,
         ray_address: str | None = None, progress: bool | None = None,
         on_oversize: str = "error", knobs: dict | None = None,
         gpu_hour_usd: float | None = None) -> PlanResult:
    """Simulate every point of the search space and rank them (see the module doc).
    `knobs`: engine knobs all deployments share (``{"max_model_len": 262144}``);
    `gpu_hour_usd`: the price of a GPU-hour, for the cost columns."""
    from tqdm.auto import tqdm

    from labkit.engine.slo import metric_options

    if not metric_options(slo, gpu_hour_usd=gpu_hour_usd).slo:
        raise ConfigError("--slo: give at least one SLO, e.g. ttft=2,tpot=0.05")
    checks.number("min_attainment", min_attainment, low=0, high=1)
    checks.integer("jobs", jobs, low=1)
    check_run_length(duration_s, warmup_s)
    check_executor(executor, ray_address)
    for c in concurrency:
        checks.integer("concurrency", c, low=1)
    space = search_space(model, hardware, gpus, concurrency, layouts, disaggregated,
                         max_num_batched_tokens, long_prefill_token_threshold, max_groups,
                         pd_layouts, knobs)
    if not space:
        raise ConfigError(f"no layout of {model} on {hardware} fits in {gpus} GPUs")
    if on_oversize == "error":
        check_model_len(trace, model, knobs)
    warmup = _warmup(duration_s, warmup_s)
    tasks = [(asdict(d), trace, model, hardware, duration_s, warmup, slo, on_oversize, knobs,
              gpu_hour_usd) for d in space]
    rows: list[dict | None] = [None] * len(tasks)
    show = sys.stderr.isatty() if progress is None else progress
    with tqdm(total=len(tasks), desc="plan", unit="config", disable=not show) as bar:
        for i, row, err in run_tasks(evaluate, tasks, executor, jobs, ray_address):
            if err is not None:  # the worker died, or a bug: the point failed
                row = {"config": space[i].name, **asdict(space[i]), "status": "failed",
                       "error": f"{type(err).__name__}: {err}",
                       **{m: math.nan for m in METRICS}}
            rows[i] = row
            bar.update(1)
    return rank(_frame(rows), min_attainment)


def _frame(rows: list[dict]) -> pd.DataFrame:
    frame = pd.DataFrame(rows)
    for column in ("max_num_batched_tokens", "long_prefill_token_threshold"):
        frame[column] = frame[column].astype("Int64")
    return frame


def rank(results: pd.DataFrame, min_attainment: float) -> PlanResult:
    """Mark the points meeting the SLOs, rank them, and find the frontier."""
    results = results.copy()
    ok = results["status"] == "ok"
    results["meets_slo"] = ok & (results["slo_attainment"] >= min_attainment)
    order = results[results["meets_slo"]].assign(_i=range(int(results["meets_slo"].sum())))
    order = order.sort_values([*RANK_BY, "gpus", "_i"],
                              ascending=[False, False, True, True], kind="stable")
    results["rank"] = pd.Series(pd.NA, index=results.index, dtype="Int64")
    results.loc[order.index, "rank"] = range(1, len(order) + 1)
    results["pareto"] = pareto_mask(results[X_METRIC].where(ok), results[Y_METRIC].where(ok))
    best = results.loc[order.index].reset_index(drop=True)
    frontier = results[results["pareto"]].sort_values(X_METRIC).reset_index(drop=True)
    return PlanResult(results, best, frontier)
