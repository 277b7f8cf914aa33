"""What practitioners report about layouts and scheduling, checked against the model.

Each function below sets up the comparison a practitioner would run, with nothing in
the engine or the cost model written to produce the expected answer: the numbers come
out of the kernels, the layouts' placement and the scheduler. `labkit bench layouts`
prints them all with a verdict, so a change to the model that makes one of them flip
is visible at once. Where the model disagrees with the folklore it says so; the notes
in the closing report explain why.
"""

from __future__ import annotations

from labkit.costmodel import CostModel


def _t(cm, model, layout, batch, **kw) -> float:
    return cm.step_time(model, layout, batch, **kw)["seconds"]


def dcp_overhead_vs_context(cm: CostModel, contexts=(8192, 32768, 131072, 524288)) -> list:
    """tp8 vs tp8xdcp8 on DeepSeek-V3: a 4K-token agentic turn's prefill step, and a
    decode step of 16 requests (MTP 3), across cached context lengths."""
    rows = []
    for ctx in contexts:
        turn = [{"new_tokens": 4096, "context": ctx}]
        dec = [{"new_tokens": 4, "context": ctx}] * 16
        rows.append({
            "context": ctx,
            "prefill_overhead_ms": 1e3 * (_t(cm, "deepseek-v3", "tp8xdcp8", turn)
                                          - _t(cm, "deepseek-v3", "tp8", turn)),
            "decode_overhead_ms": 1e3 * (
                _t(cm, "deepseek-v3", "tp8xdcp8", dec, num_speculative_tokens=3)
                - _t(cm, "deepseek-v3", "tp8", dec, num_speculative_tokens=3)),
        })
    return rows


def cold_prefill_seconds(cm: CostModel, model: str, layout: str, tokens: int = 131072,
                         chunk: int = 8192) -> float:
    """Time to prefill a cold prompt chunk by chunk (the sum of its steps)."""
    return sum(_t(cm, model, layout, [{"new_tokens": chunk, "context": c}])
               for c in range(0, tokens, chunk))


def dep_vs_dcp(cm: CostModel, context: int = 32768, batches=(1, 2, 4, 8, 16, 64)) -> list:
    """Decode steps of DeepSeek-V3 (MTP 3) on 8 GPUs: tp8xdcp8 holds every request on
    all GPUs, dep8 spreads requests over ranks (per-rank batch = batch / 8)."""
    rows = []
    for b in batches:
        entry = {"new_tokens": 4, "context": context}
        dcp = _t(cm, "deepseek-v3", "tp8xdcp8", [entry] * b, num_speculative_tokens=3)
        ranks = [[entry] * (b // 8 + (1 if r < b % 8 else 0)) for r in range(8)]
        dep = _t(cm, "deepseek-v3", "dep8", ranks, num_speculative_tokens=3)
        rows.append({"batch": b, "per_rank_batch": b / 8, "dcp8_ms": 1e3 * dcp,
                     "dep8_ms": 1e3 * dep, "winner": "dep8" if dep < dcp else "tp8xdcp8"})
    return rows


def agentic_trace(sessions: int = 96, seed: int = 1):
    """AgentX-like sessions within a 200K-token window (compacting at 160K)."""
    from labkit.traces import generate_agentx_trace

    return generate_agentx_trace(sessions, seed=seed, context_window_tokens=200_000,
                                 compact_threshold_tokens=160_000)


def replay_summary(trace, model: str, layout: str, concurrency: int, duration_s: float,
                   warmup_s: float, **knobs) -> dict:
    from labkit.engine import Engine

    engine = Engine(model=model, layout=layout, hardware="h200", max_model_len=1 << 20,
                    **knobs)
    result = engine.replay(trace, concurrency=concurrency, duration_s=duration_s,
                           warmup_s=warmup_s, start_part_way=False)
    steps = result.steps[result.steps["start_s"] >= warmup_s]
    s = result.summary
    stall = steps["stall_s"].sum() / max(steps["rank"].nunique(), 1) / (duration_s - warmup_s)
    return {"throughput": s["throughput_tok_s_per_gpu"],
            "interactivity_p90": s["interactivity_p90_tok_s"], "ttft_p90": s["ttft_p90_s"],
            "hit_rate": s["prefix_cache_hit_rate"], "stall_share": stall}


def _print_rows(rows: list, fmt: dict) -> None:
    for r in rows:
        print("   " + "  ".join(f"{k} {fmt.get(k, '{}').format(v)}" for k, v in r.items()))


def bench_layouts(quick: bool = False) -> None:
    cm = CostModel("h200")
    print("labkit bench layouts — reported behaviours, as the model has them (h200)\n")

    print("1. DCP's per-step overhead grows with the cached context (deepseek-v3, 8 GPUs)")
    rows = dcp_overhead_vs_context(cm)
    _print_rows(rows, {"prefill_overhead_ms": "{:+8.1f}", "decode_overhead_ms": "{:+7.1f}"})
    grows = rows[-1]["prefill_overhead_ms"] > rows[0]["prefill_overhead_ms"]
    print(f"   -> prefill steps: {'yes' if grows else 'no'} (MLA prefill gathers the prefix "
          f"latents); decode steps: no, DCP's gain grows instead\n")

    print("2. PCP beats TP on long prefills of sparse-attention models (128K cold prompt)")
    for model in ("deepseek-v3.2", "deepseek-v3"):
        tp = cold_prefill_seconds(cm, model, "tp8")
        pcp = cold_prefill_seconds(cm, model, "pcp8xep8")
        print(f"   {model:14} tp8 {tp:6.2f} s   pcp8xep8 {pcp:6.2f} s   PCP/TP {pcp / tp:.2f}")
    print("   -> yes for DSA: TP reruns the indexer on every rank, PCP splits it\n")

    print("3. DEP overtakes DCP as the per-rank batch grows (decode, 32K context)")
    rows = dep_vs_dcp(cm)
    _print_rows(rows, {"per_rank_batch": "{:5.3g}", "dcp8_ms": "{:7.2f}", "dep8_ms": "{:7.2f}"})
    print("   -> yes: DCP wins below one request per rank, DEP from there on\n")

    print("7a. PP pays off on cold long prompts (llama-3.1-70b, 128K cold prompt)")
    tp = cold_prefill_seconds(cm, "llama-3.1-70b", "tp8")
    pp = cold_prefill_seconds(cm, "llama-3.1-70b", "tp4xpp2")
    print(f"   tp8 {tp:6.2f} s   tp4xpp2 {pp:6.2f} s  -> {'yes' if pp < tp else 'no'}\n")

    sessions, duration, warmup = (48, 600, 150) if quick else (96, 1200, 300)
    trace = agentic_trace(sessions)
    fmt = {"throughput": "{:8.1f}", "interactivity_p90": "{:6.2f}", "ttft_p90": "{:6.2f}",
           "hit_rate": "{:.3f}", "stall_share": "{:.3f}"}

    def compare(title, cases, model, layout, concurrency, **common):
        print(title)
        for label, knobs in cases:
            knobs = dict(knobs)
            where = knobs.pop("layout", layout)
            r = replay_summary(trace, model, where, concurrency, duration, warmup,
                               **{**common, **knobs})
            print(f"   {label:28}" + "  ".join(f"{k} {fmt[k].format(v)}" for k, v in r.items()))
        print()

    dsv3 = dict(kv_cache_dtype="fp8", num_speculative_tokens=3, acceptance_length=2.99,
                router="session_sticky")
    compare("4. long_prefill_token_threshold raises throughput and tail interactivity "
            "(llama-3.1-70b tp8, c=32)",
            [("threshold 0", dict(long_prefill_token_threshold=0)),
             ("threshold 4096", dict(long_prefill_token_threshold=4096))],
            "llama-3.1-70b", "tp8", 32)
    compare("5. prefill_schedule_interval > 1 cuts lockstep stalls (deepseek-v3 dep8, c=48)",
            [("interval 1", dict(prefill_schedule_interval=1)),
             ("interval 16", dict(prefill_schedule_interval=16))],
            "deepseek-v3", "dep8", 48, **dsv3)
    compare("6. session-sticky routing beats load balancing (llama-3.1-70b dp4xtp2, c=16)",
            [("session_sticky", dict(router="session_sticky")),
             ("least_loaded", dict(router="least_loaded")),
             ("least_loaded, recompute", dict(router="least_loaded",
                                              session_kv_migration="recompute"))],
            "llama-3.1-70b", "dp4xtp2", 16)
    compare("7b. ...but not on warm agentic turns (llama-3.1-70b, c=16)",
            [("tp8", {}), ("tp4xpp2", dict(layout="tp4xpp2"))], "llama-3.1-70b", "tp8", 16)
