"""`labkit validate`: the measured runs, their split, the replayed workload, the report's
JSON and the fit's view of the data (held-out runs never reach it). Needs ../shared/data
(skipped without it)."""

import json

import numpy as np
import pandas as pd
import pytest
from support import SHARED_DATA

E2E = SHARED_DATA / "e2e" / "blis_h100_vllm"
pytestmark = pytest.mark.skipif(not E2E.is_dir(), reason=f"measured runs not found at {E2E}")

FITTED_RUN = "20260217-155451-llama-2-7b-tp1-codegen"
HELD_OUT_RUN = "16-llama-3-1-8b-tp1-general-1"


@pytest.fixture(scope="module")
def runs():
    from labkit.validate.runs import load_runs

    return load_runs(SHARED_DATA)


def test_split_follows_provenance(runs):
    ok = runs[runs["skip"].isna()]
    assert set(ok.loc[ok["source"] == "default_args", "part"]) == {"fitted"}
    assert set(ok.loc[ok["source"] == "s2r", "part"]) == {"held_out"}
    assert (ok["part"] == "fitted").sum() == 12  # 16 runs, the 4 reasoning ones overloaded
    assert (ok["part"] == "held_out").sum() >= 20
    assert ok["id"].is_unique
    # no held-out run repeats a fitted one (the CSV's duplicates are skipped)
    skipped = runs[runs["skip"].notna()]
    assert skipped["skip"].str.contains("duplicate").sum() >= 7
    assert skipped["skip"].str.contains("lite").any()


def test_startup_tail_flags_runs_whose_stage_mean_passes_its_p90(runs):
    """`ttft_tail`: some load stage of the run (not its whole-run row) has a TTFT mean
    above its own p90 -- read here from the CSVs row by row."""
    default = pd.read_csv(E2E / "default_args_stage_metrics.csv")
    s2r = pd.read_csv(E2E / "s2r_measured_aggregates.csv")
    expected = {}
    for _, r in default.iterrows():
        if r["stage"] != "summary":
            tail = r["ttft_mean_ms"] > r["ttft_p90_ms"]
            expected[r["experiment"]] = expected.get(r["experiment"], False) or tail
    for _, r in s2r.iterrows():
        if r["stage_index"] >= 0:
            tail = r["ttft_mean"] > r["ttft_p90"]
            expected[r["folder"]] = expected.get(r["folder"], False) or tail
    got = dict(zip(runs["id"], runs["ttft_tail"]))
    assert got == {k: expected.get(k, False) for k in got}
    # the Mixtral runs' first stage (TP2: p99 0.2-0.85 s): the tails this is for; no
    # dense model's run has one
    assert got["28-mixtral-8x7b-tp2-general-2"] and got["30-mixtral-8x7b-tp2-general-2"]
    assert not got[HELD_OUT_RUN] and not got[FITTED_RUN]
    assert 8 <= sum(got.values()) and all("mixtral" in k for k, tail in got.items() if tail)


def test_stage_measured_rows_are_the_csvs_stage_rows(runs):
    """`stage_measured`: each load stage's row of the CSV, in seconds, in the order the
    stages ran (a stage listed twice, once)."""
    by_id = runs[runs["skip"].isna()].set_index("id")
    default = pd.read_csv(E2E / "default_args_stage_metrics.csv")
    rows = default[default["experiment"] == FITTED_RUN].set_index("stage")
    stages = by_id.loc[FITTED_RUN, "stage_measured"]
    assert len(stages) == 2
    for k, stage in enumerate(stages):
        r = rows.loc[f"stage_{k}"]
        assert stage["ttft_mean"] == pytest.approx(r["ttft_mean_ms"] / 1e3)
        assert stage["e2e_p90"] == pytest.approx(r["e2e_p90_ms"] / 1e3)
        assert stage["tpot"] == pytest.approx((r["e2e_mean_ms"] - r["ttft_mean_ms"]) / 1e3 / 246)
    s2r = pd.read_csv(E2E / "s2r_measured_aggregates.csv")
    rows = s2r[s2r["folder"] == HELD_OUT_RUN].set_index("stage_index")
    stages = by_id.loc[HELD_OUT_RUN, "stage_measured"]
    assert [st["ttft_p90"] for st in stages] == pytest.approx(
        [rows.loc[0, "ttft_p90"] / 1e3, rows.loc[1, "ttft_p90"] / 1e3])
    # the rates rise from stage 0 to 1 in the two-stage workloads, and so does the TPOT
    assert stages[1]["tpot"] > stages[0]["tpot"]
    assert len(by_id.loc["64-qwen2-5-7b-instruct-tp1-roleplay-1-1", "stage_measured"]) == 1
    # the train/val file lists some stages three times
    assert {len(st) for st in runs["stage_measured"]} == {1, 2}


def test_simulated_stages_split_the_runs_requests(runs):
    """A replay's stage metrics are those of the requests sent in each stage: their
    counts add up to the measured requests, their request-weighted means to the run's."""
    from labkit.validate.simulate import simulate_run

    run = runs[runs["skip"].isna()].set_index("id").loc[FITTED_RUN]
    sim = simulate_run(run, 0.05)
    stages = sim["stages"]
    counts = np.array([st["requests"] for st in stages])
    assert len(stages) == 2 and (counts > 0).all()
    # every request completes; the first 100 (the cold cycle) are left out
    assert counts.sum() == sim["completed"] - 100
    for m in ("ttft_mean", "e2e_mean"):
        means = np.array([st[m] for st in stages])
        assert (means * counts).sum() / counts.sum() == pytest.approx(sim[m], rel=1e-12)
    # stage 1 (10 req/s) is sent after stage 0 (5 req/s): more requests in half the share
    # of the scaled seconds -- 30 s at 10/s against 30 s at 5/s less the cold cycle
    assert counts[1] == 300 and counts[0] == 150 - 100


def test_measured_tpot_is_the_readme_derived_nominal_one(runs):
    """TPOT = (E2E mean - TTFT mean) / (nominal output - 1): the CSV's own column."""
    csv = pd.read_csv(E2E / "default_args_stage_metrics.csv")
    csv = csv[csv["stage"] == "summary"].set_index("experiment")
    for _, run in runs[runs["source"] == "default_args"].iterrows():
        assert run["tpot"] * 1e3 == pytest.approx(
            csv.loc[run["id"], "derived_tpot_nominal_ms"], rel=1e-9)


def test_workload_trace_is_shared_prefix_at_constant_rate():
    from labkit.validate.workload import shared_prefix_trace

    trace = shared_prefix_trace(((8.0, 600.0), (20.0, 600.0)), 575, 100, 248,
                                duration_scale=0.1)
    reqs = trace.requests
    assert len(reqs) == 8 * 60 + 20 * 60
    assert reqs[1].timestamp == pytest.approx(1 / 8)
    assert reqs[480].timestamp == pytest.approx(60.0)  # the second stage starts at 60 s
    assert reqs[481].timestamp - reqs[480].timestamp == pytest.approx(1 / 20)
    full_system = 100 // 16
    # prompts 0..9 share group 0's system-prompt blocks, prompt 10 starts group 1
    assert np.array_equal(reqs[3].hash_ids[:full_system], reqs[7].hash_ids[:full_system])
    assert not np.array_equal(reqs[3].hash_ids[:full_system], reqs[13].hash_ids[:full_system])
    assert reqs[3].hash_ids[full_system] != reqs[7].hash_ids[full_system]
    # 100 distinct prompts, cycled
    assert np.array_equal(reqs[5].hash_ids, reqs[105].hash_ids)
    assert all(r.input_length == 575 and r.output_length == 248 for r in reqs)


def test_report_json_has_both_parts(tmp_path):
    from labkit.cli import main

    out = tmp_path / "v.json"
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["validate", "--data", str(SHARED_DATA), "--json", "--duration-scale",
                     "0.02", "--run", FITTED_RUN, "--run", HELD_OUT_RUN]) == 0
    out.write_text(buf.getvalue())
    doc = json.loads(out.read_text())
    assert set(doc) >= {"experiments", "median_ape", "median_ape_holdout"}
    metrics = {"ttft_mean", "ttft_p90", "e2e_mean", "e2e_p90", "tpot", "throughput"}
    assert set(doc["median_ape"]) >= metrics and set(doc["median_ape_holdout"]) >= metrics
    by_id = {e["id"]: e for e in doc["experiments"]}
    assert by_id[FITTED_RUN]["part"] == "fitted" and by_id[HELD_OUT_RUN]["part"] == "held_out"
    for e in doc["experiments"]:
        for m in ("ttft_mean", "e2e_mean", "tpot"):
            sim, meas = e[f"simulated_{m}"], e[f"measured_{m}"]
            assert e[f"ape_{m}"] == pytest.approx(abs(sim / meas - 1) * 100)
    # one run per part: each median is that run's error
    assert doc["median_ape"]["e2e_mean"] == pytest.approx(by_id[FITTED_RUN]["ape_e2e_mean"])
    assert doc["median_ape_holdout"]["tpot"] == pytest.approx(by_id[HELD_OUT_RUN]["ape_tpot"])
    assert doc["median_ape_holdout"]["throughput"] is None  # s2r publishes no throughput
    # the signed error per model: one run each here, so its own (sim / measured - 1)
    bias = {(b["model"], b["layout"]): b for b in doc["bias"]}
    assert len(bias) == 2
    for e in doc["experiments"]:
        b = bias[(e["model"], e["layout"])]
        assert b["runs"] == 1 and b["part"] == e["part"]
        for m in ("ttft_mean", "ttft_p90", "e2e_mean", "tpot"):
            assert b[m] == pytest.approx((e[f"simulated_{m}"] / e[f"measured_{m}"] - 1) * 100)
            assert abs(b[m]) == pytest.approx(e[f"ape_{m}"])
        assert b["tail_runs"] == int(e["measured_ttft_tail"])
    # per load stage: both runs have two, each row the run's stage from the CSV
    stages = pd.DataFrame(doc["stages"])
    assert sorted(stages["id"]) == sorted([FITTED_RUN, FITTED_RUN, HELD_OUT_RUN, HELD_OUT_RUN])
    runs = pd.DataFrame(doc["experiments"]).set_index("id")
    from labkit.validate.runs import load_runs

    runs_all = load_runs(SHARED_DATA)
    measured = runs_all[runs_all["skip"].isna()].set_index("id")["stage_measured"]
    for row in doc["stages"]:
        assert row["measured_tpot"] == pytest.approx(measured[row["id"]][row["stage"]]["tpot"])
        assert row["model"] == runs.loc[row["id"], "model"]
    assert [r["rate"] for r in doc["stages"] if r["id"] == FITTED_RUN] == [5.0, 10.0]
    # the stage bias of one run per model: that stage's own signed error -- none where
    # a replay this short sent the stage's requests inside its cold cycle (stage 0 of
    # both: 60 and 96 requests, the first 100 left out)
    for b in doc["stage_bias"]:
        (row,) = [r for r in doc["stages"] if r["model"] == b["model"]
                  and r["stage"] == b["stage"]]
        if row["requests"] == 0:
            assert row["simulated_tpot"] is None and b["tpot"] is None
        else:
            assert b["tpot"] == pytest.approx(
                (row["simulated_tpot"] / row["measured_tpot"] - 1) * 100)
    assert len(doc["stage_bias"]) == 4
    assert [r["stage"] for r in doc["stages"] if r["requests"] == 0] == [0, 0]


def test_signed_bias_averages_a_models_runs_with_their_sign():
    from labkit.validate.report import signed_bias

    exp = pd.DataFrame([
        dict(model="a", layout="tp1", part="fitted", simulated_tpot=0.9, measured_tpot=1.0,
             simulated_ttft_mean=1.1, measured_ttft_mean=1.0, simulated_e2e_mean=2.0,
             measured_e2e_mean=2.0, measured_ttft_tail=True),
        dict(model="a", layout="tp1", part="held_out", simulated_tpot=1.3, measured_tpot=1.0,
             simulated_ttft_mean=1.1, measured_ttft_mean=1.0, simulated_e2e_mean=1.0,
             measured_e2e_mean=2.0, measured_ttft_tail=False),
        dict(model="a", layout="tp2", part="held_out", simulated_tpot=0.5, measured_tpot=1.0,
             simulated_ttft_mean=1.0, measured_ttft_mean=1.0, simulated_e2e_mean=1.0,
             measured_e2e_mean=1.0, measured_ttft_tail=True)])
    exp = exp.assign(simulated_ttft_p90=[0.9, 1.0, 1.2], measured_ttft_p90=[1.0, 1.0, 1.0])
    bias = signed_bias(exp)
    assert bias.loc[("a", "tp1"), "ttft_p90"] == pytest.approx(-5.0)
    assert bias.loc[("a", "tp2"), "ttft_p90"] == pytest.approx(20.0)
    assert bias.loc[("a", "tp1"), "tail_runs"] == 1 and bias.loc[("a", "tp2"), "tail_runs"] == 1
    assert bias.loc[("a", "tp1"), "tpot"] == pytest.approx(10.0)  # -10 and +30: signs kept
    assert bias.loc[("a", "tp1"), "ttft_mean"] == pytest.approx(10.0)
    assert bias.loc[("a", "tp1"), "e2e_mean"] == pytest.approx(-25.0)
    assert bias.loc[("a", "tp1"), "runs"] == 2
    assert bias.loc[("a", "tp1"), "part"] == "fitted/held_out"
    assert bias.loc[("a", "tp2"), "tpot"] == pytest.approx(-50.0)


def test_stage_bias_groups_two_stage_runs_by_stage():
    from labkit.validate.report import stage_bias

    def row(run, stage, rate, sim_tpot, model="a"):
        return dict(id=run, part="held_out", model=model, layout="tp1", stage=stage,
                    rate=rate, measured_ttft_tail=False, simulated_tpot=sim_tpot,
                    measured_tpot=1.0, simulated_ttft_mean=1.0, measured_ttft_mean=1.0,
                    simulated_ttft_p90=1.0, measured_ttft_p90=1.0)
    stages = pd.DataFrame([row("r1", 0, 8.0, 0.9), row("r1", 1, 20.0, 1.1),
                           row("r2", 0, 6.0, 0.95), row("r2", 1, 10.0, 1.3),
                           row("r3", 0, 6.0, 0.5)])  # one stage only: left out
    bias = stage_bias(stages)
    assert bias.loc[("a", "tp1", 0), "tpot"] == pytest.approx(-7.5)
    assert bias.loc[("a", "tp1", 1), "tpot"] == pytest.approx(20.0)
    assert bias.loc[("a", "tp1", 0), "runs"] == 2
    assert bias.loc[("a", "tp1", 1), "rate"] == pytest.approx(15.0)
    assert stage_bias(stages[stages["id"] == "r3"]).empty


def test_unknown_run_is_refused(capsys):
    from labkit.cli import main

    assert main(["validate", "--data", str(SHARED_DATA), "--run", "no-such-run"]) == 2
    assert "no-such-run" in capsys.readouterr().err


def test_fit_never_sees_held_out_runs(monkeypatch):
    """The fit replays the fitted part only; its answer comes from those runs."""
    import labkit.validate.fit as fit_module

    seen = []

    def fake_simulate(run, scale, params, frontend_s):
        seen.append(run["id"])
        # a sim whose TPOT is off by exactly the gap it is given minus 0.4 ms
        return {"tpot": run["tpot"] + params.step_gap_s - 4e-4,
                "ttft_mean": run["ttft_mean"] - 5e-3}

    monkeypatch.setattr(fit_module, "simulate_run", fake_simulate)
    result = fit_module.fit(SHARED_DATA)
    from labkit.validate.runs import load_runs

    runs = load_runs(SHARED_DATA)
    fitted = set(runs.loc[(runs["part"] == "fitted") & runs["skip"].isna(), "id"])
    assert set(seen) == fitted
    assert result["step_gap_s"] == pytest.approx(4e-4, abs=2e-5)
    assert result["frontend_s"] == pytest.approx(5e-3)
