"""P/D rate matching: phase 1 (each role alone, to saturation) and phase 2 (the
whole system at P:D ratios around decode_rate / prefill_rate)."""

import math

import pandas as pd
import pytest

from labkit.cli import main
from labkit.experiments.rate_matching import (
    candidate_ratios, pd_profile, pd_sweep, role_engine, saturation_table)
from tests.support import small_agentx

GRID = (1, 2, 4, 8, 16)


@pytest.fixture(scope="module")
def trace():
    return small_agentx(8, seed=1)


@pytest.fixture(scope="module")
def profile(trace):
    return pd_profile("llama-3.1-8b", trace, ["tp1"], ["tp1", "tp2"], concurrency=GRID,
                      duration_s=10)


def test_candidate_ratios_surround_the_target():
    assert candidate_ratios(0.5, max_groups=4)[0] == (1, 2)
    assert candidate_ratios(1.5, max_groups=4)[0] == (3, 2)
    pairs = candidate_ratios(0.7, max_groups=3, count=20)
    assert len({p / d for p, d in pairs}) == len(pairs)  # distinct ratios
    assert all(1 <= p <= 3 and 1 <= d <= 3 for p, d in pairs)
    gaps = [abs(math.log(p / d / 0.7)) for p, d in pairs]
    assert gaps == sorted(gaps)


def test_each_role_plays_alone():
    trace = small_agentx(4, seed=2)
    prefill = role_engine("prefill", "llama-3.1-8b", "tp1").replay(
        trace, concurrency=4, duration_s=10, max_idle_s=0).requests
    prefill = prefill[prefill["completed"]]
    assert len(prefill) > 10 and (prefill["output_tokens"] == 1).all()
    decode = role_engine("decode", "llama-3.1-8b", "tp1").replay(
        trace, concurrency=4, duration_s=10, max_idle_s=0).requests
    done = decode[decode["completed"]]
    # the prompt arrives computed: one token of it is left to the first decode step
    assert (done["computed_prefill_tokens"] == 1).all()
    assert (done["cached_tokens"] == done["input_tokens"] - 1).all()
    assert (done["output_tokens"] > 1).any()


def test_profile_raises_concurrency_until_saturation(profile):
    for (role, _layout), rows in profile.groupby(["role", "layout"]):
        tried = list(rows["concurrency"])
        assert tried == list(GRID[:len(tried)])  # doubling, stopped early at most
        assert rows["saturated"].sum() == 1
        best = rows[rows["saturated"]].iloc[0]
        assert best["calls_s"] == rows["calls_s"].max()
        if len(tried) < len(GRID):  # stopped: the last step gained less than 5 %
            last, before = rows.iloc[-1], rows.iloc[-2]
            assert last["calls_s"] < 1.05 * before["calls_s"] or last["preemptions"] > 0
        column = "ttft_p50_s" if role == "prefill" else "tpot_p50_s"
        assert rows[column].notna().all()
    table = saturation_table(profile)
    assert set(table.index) == {("prefill", "tp1"), ("decode", "tp1"), ("decode", "tp2")}
    assert (table["calls_s_per_gpu"] * table["gpus"] - table["calls_s"]).abs().max() < 1e-9


def test_sweep_replays_the_candidates_around_the_match(trace, profile):
    rates = saturation_table(profile)
    target = rates.loc[("decode", "tp2"), "calls_s"] / rates.loc[("prefill", "tp1"), "calls_s"]
    sweep = pd_sweep("llama-3.1-8b", trace, "tp1", "tp2", profile=profile, max_groups=3,
                     count=3, duration_s=10)
    assert list(zip(sweep["P"], sweep["D"])) == candidate_ratios(target, 3, 3)
    assert sweep["target_P_over_D"].iloc[0] == pytest.approx(target)
    assert (sweep["gpus"] == sweep["P"] * 1 + sweep["D"] * 2).all()
    assert (sweep["calls_s"] > 0).all() and (sweep["kv_pd_transferred_tokens"] > 0).all()
    fixed = pd_sweep("llama-3.1-8b", trace, "tp1", "tp2", ratios=[(1, 1), (2, 1)],
                     concurrency=8, duration_s=10, warmup_s=1.0)
    assert list(fixed["P"]) == [1, 2] and fixed["target_P_over_D"].isna().all()
    # with the decode side as the bottleneck, a second prefill group buys little
    one, two = fixed["calls_s"]
    assert two < 1.5 * one


def test_pd_commands_write_the_tables(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    assert main(["trace", "gen", "--sessions", "4", "--seed", "1", "--tiny",
                 "--out", str(path)]) == 0
    out = tmp_path / "prof"
    assert main(["pd", "profile", "--trace", str(path), "--model", "llama-3.1-8b",
                 "--prefill-layouts", "tp1", "--decode-layouts", "tp1", "--concurrency",
                 "1,2,4", "--duration-s", "5", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "== saturation" in printed
    sat = pd.read_parquet(out / "saturation.parquet")
    assert sorted(sat["role"]) == ["decode", "prefill"]
    assert len(pd.read_parquet(out / "profile.parquet")) >= 4
    assert main(["pd", "sweep", "--trace", str(path), "--model", "llama-3.1-8b",
                 "--prefill-layout", "tp1", "--decode-layout", "tp1", "--ratios", "1:1,1:2",
                 "--concurrency", "4", "--duration-s", "5", "--out", str(out)]) == 0
    sweep = pd.read_parquet(out / "sweep.parquet")
    assert list(zip(sweep["P"], sweep["D"])) == [(1, 1), (1, 2)]


@pytest.mark.parametrize("argv, words", [
    (["sweep", "--prefill-layout", "tp1", "--decode-layout", "pcp2"], ["decode layout"]),
    (["sweep", "--prefill-layout", "tp1", "--decode-layout", "tp1", "--ratios", "1:0"],
     ["--ratios"]),
    (["profile", "--prefill-layouts", "tp3"], ["tp3"]),
    (["profile", "--decode-layouts", "tp1", "--concurrency", "0,2"], ["--concurrency"]),
    (["profile"], ["at least one"]),
    (["profile", "--decode-layouts", "tp1", "--warmup-s", "9"], ["warmup_s=9", "duration_s"]),
    (["profile", "--decode-layouts", "tp1", "--where", "Model"], ["--where 'Model'"]),
    (["profile", "--decode-layouts", "tp1", "--where", "Model=x"],
     ["flat rows", "is a labkit trace"]),
])
def test_bad_pd_input_exits_2_before_running(tmp_path, capsys, argv, words):
    path = tmp_path / "t.jsonl"
    assert main(["trace", "gen", "--sessions", "2", "--seed", "1", "--tiny",
                 "--out", str(path)]) == 0
    capsys.readouterr()
    code = main(["pd", *argv, "--trace", str(path), "--model", "llama-3.1-8b",
                 "--duration-s", "5", "--out", str(tmp_path / "never")])
    err = capsys.readouterr().err
    assert code == 2
    for word in words:
        assert word in err
    assert not (tmp_path / "never").exists()
