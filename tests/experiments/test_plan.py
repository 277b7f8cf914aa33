"""`labkit plan`: the planner's pick is the best point of an exhaustive sweep of a small
space, computed here by running every configuration on its own; the CLI's tables,
exit codes and refusals."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from labkit.cli import main
from labkit.engine import Engine
from labkit.engine.disagg import PDEngine
from labkit.experiments.frontier import pareto_mask
from labkit.experiments.plan import plan, search_space
from labkit import Trace
from labkit.traces import TraceRequest
from labkit.traces.io import write_trace
from tests.support import small_agentx

SMALL_TRACE = str(Path(__file__).resolve().parents[2] / "data" / "traces" / "agentx_small.jsonl.gz")

MODEL, GPUS, SLO, CONCURRENCY, DURATION = "llama-3.1-8b", 2, "ttft=0.05,tpot=0.0055", 12, 20.0
BATCHED = (256, 4096)
# every deployment of llama-3.1-8b within 2 GPUs, written out by hand: one GPU, the
# 2-GPU layouts the model accepts, and one prefill tp1 group with one decode tp1 group
SHAPES = [("tp1", None), ("dp2", None), ("pcp2xdcp2", None), ("tp2", None), ("tp1", "tp1")]


@pytest.fixture(scope="module")
def trace():
    return small_agentx(12, seed=3)


@pytest.fixture(scope="module")
def planned(trace):
    return plan(trace, MODEL, "h200", GPUS, SLO, concurrency=(CONCURRENCY,),
                duration_s=DURATION, max_num_batched_tokens=BATCHED, jobs=2, progress=False)


def reference(trace) -> pd.DataFrame:
    """Each configuration replayed here, one after another, without the planner."""
    rows = []
    for decode, prefill in SHAPES:
        for batched in BATCHED:
            if prefill is None:
                engine = Engine(MODEL, decode, "h200", max_num_batched_tokens=batched)
            else:
                engine = PDEngine(MODEL, prefill, decode, "h200", 1, 1,
                                  max_num_batched_tokens=batched)
            s = engine.replay(trace, concurrency=CONCURRENCY, duration_s=DURATION,
                              warmup_s=DURATION / 5, slo=SLO).summary
            rows.append({"layout": decode, "prefill_layout": prefill, "batched": batched,
                         "gpus": s["gpus"], "good": s["goodput_req_s_per_gpu"],
                         "tput": s["throughput_tok_s_per_gpu"],
                         "inter": s["interactivity_p90_tok_s"],
                         "attainment": s["slo_attainment"]})
    return pd.DataFrame(rows)


def test_the_search_space_is_every_legal_deployment():
    space = search_space(MODEL, "h200", GPUS, max_num_batched_tokens=BATCHED)
    assert sorted((d.layout, str(d.prefill_layout), d.max_num_batched_tokens) for d in space) \
        == sorted((lay, str(pre), b) for lay, pre in SHAPES for b in BATCHED)
    assert all(d.gpus <= GPUS for d in space)
    # no decode group that splits prompts by tokens (PCP is for prefill)
    assert not [d for d in search_space(MODEL, "h200", 4) if "pcp" in d.layout
                and d.prefill_layout is not None]


def test_the_pick_is_the_best_of_an_exhaustive_sweep(trace, planned):
    ref = reference(trace)
    meets = ref[ref["attainment"] >= 0.9]
    assert 0 < len(meets) < len(ref)  # the SLOs separate the configurations
    top = meets[(meets["good"] == meets["good"].max())]
    top = top[top["tput"] == top["tput"].max()]
    best = planned.best.iloc[0]
    assert (best["layout"], best["prefill_layout"], best["max_num_batched_tokens"]) in \
        {(r.layout, r.prefill_layout, r.batched) for r in top.itertuples()}
    assert best["goodput_req_s_per_gpu"] == top["good"].iloc[0]  # same simulation, bit for bit
    assert len(planned.best) == len(meets)
    assert planned.best["goodput_req_s_per_gpu"].is_monotonic_decreasing
    # the frontier: the reference's own Pareto set (both metrics maximised)
    mask = pareto_mask(ref["inter"], ref["tput"])
    expected = sorted(zip(ref["inter"][mask], ref["tput"][mask]))
    got = sorted(zip(planned.frontier["interactivity_p90_tok_s"],
                     planned.frontier["throughput_tok_s_per_gpu"]))
    assert np.allclose(expected, got, rtol=0, atol=0)


def test_the_command_prints_and_writes_the_tables(tmp_path, trace, planned, capsys):
    path = tmp_path / "t.jsonl"
    write_trace(trace, path)
    argv = ["plan", "--trace", str(path), "--model", MODEL, "--gpus", str(GPUS), "--slo", SLO,
            "--concurrency", str(CONCURRENCY), "--duration-s", str(DURATION),
            "--max-num-batched-tokens", "256,4096", "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "best, by goodput per GPU:" in out and "frontier:" in out
    written = pd.read_parquet(tmp_path / "out" / "plan.parquet")
    pd.testing.assert_frame_equal(written, planned.results, check_dtype=False)
    assert main([*argv[:-1], "--slo", "ttft=0.000001"]) == 1  # nothing meets it
    assert "0 meet the SLOs" in capsys.readouterr().out


@pytest.mark.parametrize("extra, message", [
    (["--executor", "spark"], "--executor 'spark' is not known; allowed: local, ray"),
    (["--layouts", "tp3"], "--layouts 'tp3' is not a legal layout of llama-3.1-8b"),
    (["--slo", "ttft=-1"], "ttft=-1"),
    (["--concurrency", "8,x"], "--concurrency '8,x': give integers"),
    (["--gpu-hour-usd", "-2"], "gpu_hour_usd=-2.0 must be a finite price >= 0"),
    (["--window", "5"], "--window '5': give START:END"),
    (["--where", "Model=x"], "--where picks rows of the traces whose calls are flat rows"),
])
def test_bad_input_is_refused_before_anything_runs(tmp_path, capsys, extra, message):
    argv = ["plan", "--trace", SMALL_TRACE, "--model", MODEL,
            "--gpus", "2", "--slo", "ttft=1", "--out", str(tmp_path / "out"), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_a_price_gives_each_configuration_its_cost_per_million_tokens(trace, capsys, tmp_path):
    """Every GPU is paid for the measured window, so a point's cost per million tokens
    is the price per GPU-second over its tokens per GPU-second (an identity of the
    summary's own figures), and the command prints the column."""
    price = 3.5
    result = plan(trace, MODEL, "h200", GPUS, SLO, concurrency=(CONCURRENCY,), duration_s=10.0,
                  layouts=["tp1", "tp2"], disaggregated=False, progress=False,
                  gpu_hour_usd=price)
    rows = result.results
    assert len(rows) == 2 and (rows["status"] == "ok").all()
    expected = price / 3600 / rows["throughput_tok_s_per_gpu"] * 1e6
    assert np.allclose(rows["usd_per_m_tokens"], expected, rtol=1e-12, atol=0)
    assert (rows["usd_per_m_output_tokens"] > rows["usd_per_m_tokens"]).all()
    # without a price the columns are there, empty, and not printed
    unpriced = plan(trace, MODEL, "h200", GPUS, SLO, concurrency=(CONCURRENCY,),
                    duration_s=10.0, layouts=["tp1"], disaggregated=False, progress=False)
    assert unpriced.results["usd_per_m_tokens"].isna().all()
    path = tmp_path / "t.jsonl"
    write_trace(trace, path)
    argv = ["plan", "--trace", str(path), "--model", MODEL, "--gpus", str(GPUS), "--slo", SLO,
            "--concurrency", str(CONCURRENCY), "--duration-s", "10", "--layouts", "tp1",
            "--no-pd", "--no-progress"]
    main(argv)
    assert "usd_per_m_tokens" not in capsys.readouterr().out
    main([*argv, "--gpu-hour-usd", str(price)])
    assert "usd_per_m_tokens" in capsys.readouterr().out


def test_a_refused_configuration_says_why(tmp_path, capsys):
    """Points the engine refuses (here a call longer than any layout's KV within two
    L40S) are printed with their reasons, counted; a call longer than max_model_len is
    refused before anything runs, since every point would be."""
    n = 900_000
    trace = Trace(64, [TraceRequest("A", "huge", None, "main", 0.0, n, 10,
                                    list(range(-(-n // 64))))])
    path = tmp_path / "t.jsonl"
    write_trace(trace, path)
    argv = ["plan", "--trace", str(path), "--model", MODEL, "--hardware", "l40s", "--gpus", "2",
            "--slo", "ttft=1", "--duration-s", "5", "--no-progress"]
    assert main([*argv, "--max-model-len", "1000000"]) == 1
    out = capsys.readouterr().out
    refusals = re.findall(r"refused (\d+)x: request huge needs \d+ KV blocks", out)
    failed = int(re.search(r"configurations simulated \((\d+) refused", out).group(1))
    assert refusals and sum(map(int, refusals)) == failed > 0
    assert f"({failed} of them for a call no rank can hold: --on-oversize skip" in out
    assert "(empty: no configuration ran)" in out
    skipping = [*argv, "--max-model-len", "1000000", "--on-oversize", "skip"]
    main(skipping)  # (no hint where calls are skipped already)
    assert "no rank can hold" not in capsys.readouterr().out
    assert main(argv) == 2  # the model's own max_model_len (131072): no point could run it
    err = capsys.readouterr().err
    assert f"request huge: {n} + 10 tokens exceed max_model_len=131072 of {MODEL}, for every " \
           f"configuration" in err


def test_a_part_of_the_trace_is_planned_as_that_part(tmp_path, trace):
    """The trace flags of `labkit replay` (here --sample-sessions) on `plan` and `pd`:
    the tables of the part written out first, and not those of the whole trace."""
    path, part = tmp_path / "t.jsonl", tmp_path / "part.jsonl"
    write_trace(trace, path)
    cut = ["--sample-sessions", "0.5", "--sample-seed", "2"]
    assert main(["trace", "convert", str(path), str(part), *cut]) == 0
    commands = {
        "plan.parquet": ["plan", "--model", MODEL, "--gpus", "1", "--slo", SLO, "--no-pd",
                         "--concurrency", "4", "--duration-s", "6", "--no-progress"],
        "profile.parquet": ["pd", "profile", "--model", MODEL, "--prefill-layouts", "tp1",
                            "--decode-layouts", "tp1", "--concurrency", "2,4",
                            "--duration-s", "6", "--no-progress"]}
    for table, argv in commands.items():
        tables = []
        for i, (source, flags) in enumerate([(path, cut), (part, []), (path, [])]):
            out = tmp_path / f"{table}-{i}"
            assert main([*argv, "--trace", str(source), *flags, "--out", str(out)]) in (0, 1)
            tables.append(pd.read_parquet(out / table))
        pd.testing.assert_frame_equal(tables[0], tables[1])
        assert not tables[0].equals(tables[2])  # (the whole trace plans otherwise)
