"""`labkit bench kv`: KV beyond one GPU's pool, in figures (sim plane, one run each).

- offload tiers: an agentic replay whose GPU prefix cache is too small for its
  sessions, without tiers, with a CPU tier (LRU, ARC), with CPU + disk;
- hybrid models: Kimi-Linear's prefix hits under each state-snapshot retention;
- HiSparse: DeepSeek-V3.2 with its latents in host memory, GPU buffers of N tokens;
- per-layer vs packed KV: copy descriptors and the time to load a 64K-token prefix
  from host memory;
- sliding-window layers: gpt-oss-120b with its window pages freed as the window
  moves, against the same model keeping every layer's KV (no hybrid allocator).
"""

from __future__ import annotations

import time

import pandas as pd


def _run(label: str, engine, trace, **kw) -> dict:
    t0 = time.perf_counter()
    s = engine.replay(trace, start_part_way=True, **kw).summary
    return {"config": label, "calls": s["requests_completed"],
            "hit_rate": s["prefix_cache_hit_rate"],
            "local_hit_rate": s["prefix_cache_local_hit_rate"],
            "ttft_p50_s": s["ttft_p50_s"], "tpot_p50_s": s["tpot_p50_s"],
            "tok_s_per_gpu": s["throughput_tok_s_per_gpu"],
            "wall_s": time.perf_counter() - t0, **{k: v for k, v in s.items()
                                                   if k.startswith(("linear_state_hits",
                                                                    "hisparse_hit_rate",
                                                                    "kv_window", "preempt"))}}


def bench_kv(quick: bool = False) -> None:
    from labkit import Engine, generate_agentx_trace
    from labkit.engine.kv.packing import block_layout

    sessions, duration = (4, 300) if quick else (8, 900)
    pd.set_option("display.width", 200)
    trace = generate_agentx_trace(sessions, seed=0, context_window_tokens=120_000,
                                  compact_threshold_tokens=96_000)
    print(f"labkit bench kv — {sessions} AgentX sessions, closed loop, {duration} s "
          f"simulated, h200\n")

    print("1. Offload tiers: llama-3.1-8b tp1 with a 9,000-block (144K-token) GPU pool")
    rows = []
    for label, knobs in [("GPU only", {}), ("+ CPU 64 GiB, LRU", dict(cpu_kv_gib=64)),
                         ("+ CPU 64 GiB, ARC", dict(cpu_kv_gib=64, kv_offload_eviction="arc")),
                         ("+ CPU 16 GiB + disk 1 TiB", dict(cpu_kv_gib=16, disk_kv_gib=1024))]:
        engine = Engine("llama-3.1-8b", "tp1", "h200", num_gpu_blocks_override=9000, **knobs)
        rows.append(_run(label, engine, trace, concurrency=sessions, duration_s=duration))
    print(pd.DataFrame(rows).round(3).to_string(index=False), "\n")

    print("2. Hybrid prefix caching: kimi-linear-48b-a3b tp1, by linear_state_retention")
    rows = [_run(r, Engine("kimi-linear-48b-a3b", "tp1", "h200", linear_state_retention=r),
                 trace, concurrency=sessions, duration_s=duration / 3)
            for r in ("none", "interval", "selective", "both")]
    print(pd.DataFrame(rows).round(3).to_string(index=False), "\n")

    print("3. HiSparse: deepseek-v3.2 dcp8 fp8 KV, 4x the sessions")
    rows = []
    for buffer in (0, 4096, 16384):
        engine = Engine("deepseek-v3.2", "dcp8", "h200", kv_cache_dtype="fp8",
                        hisparse_buffer_tokens=buffer)
        row = _run(f"buffer {buffer}" if buffer else "all KV on GPU", engine, trace,
                   concurrency=4 * sessions, duration_s=duration / 3)
        row["blocks_per_rank"] = engine.num_blocks
        rows.append(row)
    print(pd.DataFrame(rows).round(3).to_string(index=False), "\n")

    print("4. Per-layer vs packed KV: loading a 64K-token prefix from host memory, one GPU")
    rows = []
    for model, layout in (("llama-3.1-8b", "tp1"), ("deepseek-v3", "tp8"),
                          ("deepseek-v3.2", "dcp8")):
        engine = Engine(model, layout, "h200")
        hw = engine.hardware
        for kind in ("per_layer", "packed"):
            lay = block_layout(engine.placement, engine.block_size, kind)
            blocks = 65536 // engine.block_size
            copy_s = blocks * lay.block_bytes / hw.pcie_bandwidth
            rows.append({"model": model, "layout": layout, "kv_layout": kind,
                         "descriptors_per_block": lay.descriptors_per_block,
                         "kib_per_descriptor": lay.bytes_per_descriptor / 1024,
                         "bytes_ms": 1e3 * copy_s,
                         "issue_ms": 1e3 * lay.copy_overhead_s(blocks)})
    print(pd.DataFrame(rows).round(3).to_string(index=False), "\n")

    print("5. Sliding-window layers: gpt-oss-120b tp2, 6.6 GiB of KV per GPU")
    print(_window_table(trace, sessions, duration / 3).round(3).to_string(index=False))


def _window_table(trace, concurrency: int, duration: float) -> pd.DataFrame:
    """gpt-oss with its 18 window layers freed as the window moves vs the same model
    holding their KV for the whole context (one table for every layer), in the same
    KV memory: 24,000 pages of 18 layers, or 12,000 blocks of 36."""
    import dataclasses

    from labkit import Engine
    from labkit.specs import get_model

    swa = get_model("gpt-oss-120b")
    full = dataclasses.replace(swa, name="gpt-oss-120b, every layer full",
                               sliding_window_layers=(), sliding_window=0)
    rows = []
    for model, blocks in ((swa, 24_000), (full, 12_000)):
        engine = Engine(model, "tp2", "h200", num_gpu_blocks_override=blocks)
        row = _run(model.name, engine, trace, concurrency=concurrency, duration_s=duration)
        page = engine.block_size * engine.placement.kv_bytes_per_token_per_gpu()
        row.update(pool_blocks=engine.num_blocks, page_kib=page / 1024)
        rows.append(row)
    return pd.DataFrame(rows)
