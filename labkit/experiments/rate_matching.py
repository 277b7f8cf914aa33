"""Rate matching for prefill/decode disaggregation: how many groups of each role.

**Phase 1 — profile each role alone** (`pd_profile`). A prefill group is replayed on
the trace with every call cut to its first token (the prompt work a prefill group
does, its prefix cache included); a decode group with every prompt arriving already
computed, over the network (`transfer_seconds`), as a prefill pool would send it. For
each layout, the closed-loop concurrency doubles until throughput stops growing (less
than `gain` more calls per second) or the decode KV cache starts preempting; the
best point is the role's **saturated rate**, in calls per second per group.

**Phase 2 — sweep P:D around the match** (`pd_sweep`). With P prefill groups and D
decode groups the system serves min(P × prefill_rate, D × decode_rate), so the
matched ratio is `P/D = decode_rate / prefill_rate` — the role with the higher
per-group rate needs fewer groups. Candidate (P, D) pairs nearest that ratio are
replayed in full (`PDEngine`: queueing, KV transfers, layout conversion, prefix
reuse on both sides) and reported side by side.

Tool gaps are removed (`max_idle_s=0`) in both phases: a profile measures what the
hardware sustains, not what the agents' think time allows.
"""

from __future__ import annotations

import math

import pandas as pd
from tqdm.auto import tqdm

from labkit import checks
from labkit.engine.disagg import PDEngine, check_decode_layout, check_pd_size, \
    transfer_seconds
from labkit.engine.engine import Engine
from labkit.engine.transfer import PrefixTransfer
from labkit.errors import ConfigError

ROLES = ("prefill", "decode")
DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128)


def role_engine(role: str, model, layout: str, hardware="h200", **knobs) -> Engine:
    """An engine that plays one role alone (see the module docstring)."""
    if role not in ROLES:
        raise ConfigError(f"role {role!r}: expected one of {', '.join(ROLES)}")
    if role == "prefill":
        return _FirstTokenOnly(model, layout, hardware, **knobs)
    # decode: every prompt arrives computed, as a prefill pool would send it
    return Engine(model, layout, hardware, prefix_sources=[_prompt_from_prefill], **knobs)


class _FirstTokenOnly(Engine):
    """The prefill role: every call is cut to its first token."""

    def submit(self, req, at=None) -> None:
        req.max_output_tokens, req.max_tokens = 1, 0
        super().submit(req, at)


def _prompt_from_prefill(engine: Engine):
    """A prefix source for `engine` (its maker: `Engine(prefix_sources=...)`): the prompt
    (all but its last token, which the first decode step computes) arrives as a prefill
    pool of the same layout would send it."""
    def offer(req, cached: int, now: float) -> PrefixTransfer | None:
        tokens = req.num_prompt_tokens - 1
        if req.num_output_tokens or tokens <= cached:
            return None
        seconds = transfer_seconds(engine, engine, tokens - cached)

        def admit(r, now: float) -> float:
            r.num_transferred_tokens = tokens - cached
            r.async_kv_load = True  # its landing is seen as a P/D decode group sees it
            return seconds
        return PrefixTransfer(tokens, seconds, admit)
    return offer


def profile_point(role: str, model, layout: str, trace, concurrency: int, duration_s: float,
                  hardware="h200", warmup_s: float | None = None, **knobs) -> dict:
    engine = role_engine(role, model, layout, hardware, **knobs)
    r = engine.replay(trace, concurrency=concurrency, duration_s=duration_s, max_idle_s=0.0,
                      warmup_s=_warmup(duration_s, warmup_s), start_part_way=True)
    s = r.summary
    window = s["window_s"]
    calls_s = s["requests_completed"] / window
    done = r.requests[r.requests["completed"].astype(bool)]
    row = {"role": role, "layout": layout, "gpus": engine.gpus, "concurrency": concurrency,
           "calls_s": calls_s, "calls_s_per_gpu": calls_s / engine.gpus,
           "preemptions": s["preemptions"], "kv_cache_usage_peak": s["kv_cache_usage_peak"]}
    if role == "prefill":
        row["input_tok_s_per_gpu"] = float(done["input_tokens"].sum()) / window / engine.gpus
        row["ttft_p50_s"], row["ttft_p90_s"] = s["ttft_p50_s"], s["ttft_p90_s"]
    else:
        row["output_tok_s_per_gpu"] = s["output_tok_s_per_gpu"]
        row["tpot_p50_s"], row["tpot_p90_s"] = s["tpot_p50_s"], s["tpot_p90_s"]
        row["tok_s_per_user"] = 1.0 / s["tpot_p50_s"] if s["tpot_p50_s"] > 0 else math.nan
    return row


def pd_profile(model, trace, prefill_layouts=(), decode_layouts=(), hardware="h200",
               concurrency=DEFAULT_CONCURRENCY, duration_s: float = 60.0, gain: float = 0.05,
               progress: bool = False, warmup_s: float | None = None,
               **knobs) -> pd.DataFrame:
    """Phase 1: one row per (role, layout, concurrency) tried; `saturated` marks each
    layout's best point (its rate). Concurrency stops rising once calls/s grows by
    less than `gain` (relative), or, for decode, once the KV cache preempts."""
    if not prefill_layouts and not decode_layouts:
        raise ConfigError("pd_profile needs at least one prefill or decode layout")
    check_run_length(duration_s, warmup_s)
    plan = [("prefill", lay) for lay in prefill_layouts] + \
        [("decode", lay) for lay in decode_layouts]
    for role, layout in plan:  # refuse bad layouts before the long part
        engine = role_engine(role, model, layout, hardware, **knobs)
        if role == "decode":
            check_decode_layout(engine.layout, f"decode layout {layout!r}")
    rows = []
    bar = tqdm(total=len(plan) * len(concurrency), desc="pd profile", disable=not progress)
    for role, layout in plan:
        best = None
        for c in concurrency:
            row = profile_point(role, model, layout, trace, c, duration_s, hardware,
                                warmup_s, **knobs)
            rows.append(row)
            bar.update(1)
            if role == "decode" and row["preemptions"] and best is not None:
                break  # the KV cache is full: more calls only thrash
            if best is not None and row["calls_s"] < best["calls_s"] * (1 + gain):
                best = max(best, row, key=lambda x: x["calls_s"])
                break
            best = row
        best["saturated"] = True
    bar.close()
    table = pd.DataFrame(rows)
    table["saturated"] = table["saturated"].fillna(False).astype(bool)  # one per layout
    return table


def saturation_table(profile: pd.DataFrame) -> pd.DataFrame:
    """Each (role, layout)'s saturated point: its rate per group and per GPU."""
    return profile[profile["saturated"]].set_index(["role", "layout"])


def candidate_ratios(target: float, max_groups: int = 4, count: int = 5) -> list[tuple[int, int]]:
    """The (P, D) pairs (each at most max_groups, distinct ratios) nearest the target
    P/D, nearest first."""
    pairs = {}
    for p in range(1, max_groups + 1):
        for d in range(1, max_groups + 1):
            pairs.setdefault(p / d, (p, d))  # 2:2 is 1:1, the smaller comes first
    ranked = sorted(pairs.items(), key=lambda kv: (abs(math.log(kv[0] / target)), sum(kv[1])))
    return [pd_ for _, pd_ in ranked[:count]]


def pd_sweep(model, trace, prefill_layout: str, decode_layout: str, hardware="h200",
             ratios=None, profile: pd.DataFrame | None = None, max_groups: int = 4,
             count: int = 5, concurrency: int | None = None, duration_s: float = 60.0,
             progress: bool = False, warmup_s: float | None = None,
             **knobs) -> pd.DataFrame:
    """Phase 2: replay the whole P/D system at each candidate (P, D). Without `ratios`,
    the candidates surround `P/D = decode_rate / prefill_rate` from `profile` (run
    here when not given). One row per candidate."""
    check_run_length(duration_s, warmup_s)
    pair = PDEngine(model, prefill_layout, decode_layout, hardware, 1, 1, **knobs)
    for p, d in ratios or ():  # refuse a system too large before anything runs
        check_pd_size(pair.prefill[0].layout, pair.decode[0].layout, int(p), int(d))
    target = math.nan
    rates = None
    if ratios is None:
        if profile is None:
            profile = pd_profile(model, trace, [prefill_layout], [decode_layout], hardware,
                                 duration_s=duration_s, progress=progress,
                                 warmup_s=warmup_s, **knobs)
        rates = saturation_table(profile)
        p_rate = rates.loc[("prefill", prefill_layout), "calls_s"]
        d_rate = rates.loc[("decode", decode_layout), "calls_s"]
        target = d_rate / p_rate
        ratios = candidate_ratios(target, max_groups, count)
    ratios = [tuple(int(x) for x in r) for r in ratios]
    rows = []
    for p, d in tqdm(ratios, desc="pd sweep", disable=not progress):
        c = concurrency
        if c is None:  # enough calls in flight to keep every decode group saturated
            c = d * int(rates.loc[("decode", decode_layout), "concurrency"]) \
                if rates is not None else 8 * d
        engine = PDEngine(model, prefill_layout, decode_layout, hardware, p, d, **knobs)
        r = engine.replay(trace, concurrency=c, duration_s=duration_s, max_idle_s=0.0,
                          warmup_s=_warmup(duration_s, warmup_s), start_part_way=True)
        s, steps = r.summary, r.steps
        busy = {role: _busy_share(steps[steps["role"] == role], _warmup(duration_s, warmup_s),
                                  duration_s)
                for role in ROLES}
        rows.append({
            "P": p, "D": d, "P_over_D": p / d, "target_P_over_D": target, "gpus": engine.gpus,
            "concurrency": c, "calls_s": s["requests_completed"] / s["window_s"],
            "throughput_tok_s_per_gpu": s["throughput_tok_s_per_gpu"],
            "output_tok_s_per_gpu": s["output_tok_s_per_gpu"],
            "ttft_p50_s": s["ttft_p50_s"], "ttft_p90_s": s["ttft_p90_s"],
            "tpot_p50_s": s["tpot_p50_s"], "tpot_p90_s": s["tpot_p90_s"],
            "interactivity_p90_tok_s": s["interactivity_p90_tok_s"],
            "prefill_busy": busy["prefill"], "decode_busy": busy["decode"],
            "kv_pd_transferred_tokens": s["kv_pd_transferred_tokens"],
        })
    return pd.DataFrame(rows)


def check_run_length(duration_s: float, warmup_s: float | None, spell=str) -> None:
    """Each point's simulated seconds: finite and > 0; its warm-up below them."""
    checks.number(spell("duration_s"), duration_s, low=0, low_open=True)
    checks.number(spell("warmup_s"), warmup_s, low=0, none=True)
    _warmup(duration_s, warmup_s)


def _warmup(duration_s: float, warmup_s: float | None) -> float:
    """Seconds left out of the figures: a fifth of the run unless given. Each session's
    first call prefills its whole context; with many sessions that cold start can
    outlast a fifth of a short run."""
    if warmup_s is None:
        return duration_s / 5
    if not 0 <= warmup_s < duration_s:
        raise ConfigError(f"warmup_s={warmup_s} must be >= 0 and below duration_s={duration_s}")
    return warmup_s


def _busy_share(steps: pd.DataFrame, start: float, end: float) -> float:
    """Fraction of the window the role's ranks spent computing (not idle, not stalled)."""
    inside = steps[(steps["start_s"] >= start) & (steps["start_s"] < end)]
    ranks = steps["rank"].nunique()
    return float(inside["busy_s"].sum() / ((end - start) * ranks)) if ranks else 0.0
