"""The command line: the documented interface, and errors before anything runs."""

import json
import re
import subprocess
import sys

import pytest

from labkit.cli import main


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("traces") / "agentx.jsonl"
    assert main(["trace", "gen", "--kind", "agentx", "--sessions", "3", "--seed", "1",
                 "--out", str(path)]) == 0
    return path


def test_trace_stats_json_has_the_documented_keys(capsys, trace_file):
    code, out, _ = run(capsys, "trace", "stats", trace_file, "--json")
    assert code == 0
    stats = json.loads(out)
    for key in ["sessions", "requests", "calls_per_session_median", "input_tokens_median",
                "output_tokens_median", "prefix_reuse", "subagent_session_share",
                "subagents_per_spawning_session_mean"]:
        assert key in stats
    assert stats["sessions"] == 3


def test_replay_json_and_out_dir(capsys, trace_file, tmp_path):
    out_dir = tmp_path / "run"
    code, out, err = run(capsys, "replay", "--trace", trace_file, "--model", "deepseek-v3",
                         "--layout", "dep8", "--hardware", "h200", "--concurrency", "3",
                         "--duration-s", "120", "--router", "session_sticky",
                         "--num-speculative-tokens", "3", "--acceptance-length", "2.99",
                         "--max-model-len", "1048576", "--seed", "3", "--out", out_dir,
                         "--json", "--no-progress")
    assert code == 0, err
    summary = json.loads(out)
    for key in ["gpus", "requests_completed", "sim_duration_s", "wall_s", "ttft_p50_s",
                "ttft_p90_s", "tpot_p50_s", "itl_p50_s", "e2el_p50_s",
                "interactivity_p90_tok_s", "throughput_tok_s_per_gpu", "output_tok_s_per_gpu",
                "tpgs", "prefix_cache_hit_rate", "kv_cache_usage_peak", "preemptions"]:
        assert key in summary, key
    assert summary["gpus"] == 8 and summary["sim_duration_s"] == 120
    assert sorted(p.name for p in out_dir.iterdir()) == \
        ["requests.parquet", "steps.parquet", "summary.json"]
    assert json.loads((out_dir / "summary.json").read_text())["gpus"] == 8


def test_every_engine_knob_is_a_replay_flag(capsys):
    from labkit.specs import knob_names

    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    help_text = capsys.readouterr().out
    for name in knob_names():
        assert "--" + name.replace("_", "-") in help_text
    assert "--num-gpu-blocks " in help_text


BAD_LINES = {
    "bad json": ('{"session_id": "s", oops', "JSON"),
    "missing field": ('{"session_id": "s", "request_id": "r", "parent_id": null, '
                      '"kind": "main", "delay_s": 0, "input_length": 10, '
                      '"hash_ids": [1], "block_size": 16}', "output_length"),
    "negative length": ('{"session_id": "s", "request_id": "r", "parent_id": null, '
                        '"kind": "main", "delay_s": 0, "input_length": -5, '
                        '"output_length": 3, "hash_ids": [1], "block_size": 16}',
                        "input_length"),
    "hash ids vs length": ('{"session_id": "s", "request_id": "r", "parent_id": null, '
                           '"kind": "main", "delay_s": 0, "input_length": 40, '
                           '"output_length": 3, "hash_ids": [1], "block_size": 16}',
                           "hash_ids"),
}


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_malformed_trace_exits_2_with_file_and_line(capsys, tmp_path, case):
    good = ('{"session_id": "s", "request_id": "ok", "parent_id": null, "kind": "main", '
            '"delay_s": 0, "input_length": 20, "output_length": 3, "hash_ids": [1, 2], '
            '"block_size": 16}')
    line, word = BAD_LINES[case]
    path = tmp_path / "bad.jsonl"
    path.write_text(good + "\n" + line + "\n")
    out_dir = tmp_path / "never"
    code, out, err = run(capsys, "replay", "--trace", path, "--model", "tiny-llama",
                         "--concurrency", "1", "--duration-s", "10", "--out", out_dir)
    assert code == 2
    assert f"{path}:2:" in err and word in err
    assert not out_dir.exists() and out == ""
    code, _, err = run(capsys, "trace", "stats", path)
    assert code == 2 and f"{path}:2:" in err


@pytest.mark.parametrize("flags,words", [
    (["--model", "llama-9000"], ["unknown model preset", "llama-3.1-8b", "kimi-k2"]),
    (["--model", "tiny-llama", "--layout", "tq8"], ["unknown layout dimension", "dcp"]),
    (["--model", "tiny-llama", "--layout", "tp3"], ["tp3", "attention heads"]),
    (["--model", "tiny-llama", "--gpu-memory-utilization", "1.5"], ["gpu_memory_utilization"]),
    (["--model", "tiny-llama", "--acceptance-length", "5"], ["acceptance_length"]),
    (["--model", "llama-3.1-8b", "--cpu-kv-gib", "0.0001"], ["cpu_kv_gib", "one KV block"]),
    (["--model", "llama-3.1-8b", "--disk-kv-gib", "8"], ["disk_kv_gib", "cpu_kv_gib"]),
])
def test_bad_presets_and_knobs_name_the_problem(capsys, trace_file, tmp_path, flags, words):
    out_dir = tmp_path / "never"
    code, _, err = run(capsys, "replay", "--trace", trace_file, "--concurrency", "1",
                       "--duration-s", "10", "--out", out_dir, *flags)
    assert code == 2
    for word in words:
        assert word in err
    assert not out_dir.exists()


def test_unknown_choice_knob_lists_allowed_values(capsys, trace_file):
    with pytest.raises(SystemExit) as exc:
        main(["replay", "--trace", str(trace_file), "--model", "tiny-llama",
              "--concurrency", "1", "--duration-s", "5", "--router", "random"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "session_sticky" in err and "prefix_aware" in err


def test_a_request_that_can_never_fit_is_refused_before_the_run(capsys, trace_file, tmp_path):
    out_dir = tmp_path / "never"
    code, out, err = run(capsys, "replay", "--trace", trace_file, "--model", "llama-3.1-8b",
                         "--concurrency", "1", "--duration-s", "10", "--max-model-len",
                         "2000000", "--num-gpu-blocks", "100", "--out", out_dir)
    assert code == 2 and "KV blocks" in err and "100 blocks" in err
    assert not out_dir.exists()


def test_console_script_is_installed(trace_file):
    proc = subprocess.run([sys.executable, "-m", "labkit.cli", "trace", "stats",
                           str(trace_file), "--json"], capture_output=True, text=True)
    assert proc.returncode == 0 and json.loads(proc.stdout)["sessions"] == 3


def test_unchunkable_prompt_is_refused_before_the_run(capsys, trace_file):
    code, _, err = run(capsys, "replay", "--trace", trace_file, "--model", "deepseek-v3",
                       "--layout", "dep16", "--concurrency", "1", "--duration-s", "10",
                       "--max-model-len", "2000000", "--no-enable-chunked-prefill")
    assert code == 2 and "enable_chunked_prefill" in err


def test_capacity_json_and_table(capsys):
    code, out, _ = run(capsys, "capacity", "--model", "deepseek-v3", "--layout", "tp8xdcp8",
                       "--hardware", "h200", "--context", "131072", "--kv-dtype", "fp8",
                       "--json")
    assert code == 0
    r = json.loads(out)
    for key in ["gpus", "weights_bytes_per_gpu", "kv_bytes_per_token",
                "persistent_kv_bytes_per_gpu", "temporary_kv_bytes_per_gpu",
                "kv_capacity_tokens_per_gpu", "max_concurrent_requests", "fits"]:
        assert key in r
    assert r["kv_bytes_per_token"] == 61 * 576  # fp8 latent, one copy of the model
    assert r["persistent_kv_bytes_per_gpu"] == 131072 // 8 * 61 * 576
    code, out, _ = run(capsys, "capacity", "--model", "deepseek-v3", "--layout",
                       "tp8,tp8xdcp8,dep16", "--context", "1000000")
    assert code == 0 and "tp8xdcp8" in out and "dep16" in out
    code, _, err = run(capsys, "capacity", "--model", "llama-3.1-8b", "--layout", "tp8xdcp2",
                       "--context", "1000")
    assert code == 2 and "dcp2" in err
    code, _, err = run(capsys, "capacity", "--model", "deepseek-v3", "--layout", "tp1",
                       "--context", "1000")
    assert code == 0  # does not fit: says so in the table rather than failing


def test_trace_gen_params(capsys, tmp_path):
    path = tmp_path / "t.jsonl.gz"
    code, _, err = run(capsys, "trace", "gen", "--sessions", "2", "--out", path,
                       "--param", "context_window_tokens=200000",
                       "--param", "compact_threshold_tokens=150000")
    assert code == 0, err
    code, out, _ = run(capsys, "trace", "stats", path, "--json")
    assert code == 0 and json.loads(out)["sessions"] == 2
    code, _, err = run(capsys, "trace", "gen", "--sessions", "2", "--out", path,
                       "--param", "bogus=1")
    assert code == 2 and "context_window_tokens" in err


def test_compute_replay_of_a_tiny_trace_saves_generated_tokens(capsys, tmp_path):
    import pandas as pd

    trace = tmp_path / "tiny.jsonl"
    code, out, err = run(capsys, "trace", "gen", "--sessions", "2", "--seed", "1", "--tiny",
                         "--out", trace)
    assert code == 0, err
    out_dir = tmp_path / "run"
    code, out, err = run(capsys, "replay", "--trace", trace, "--model", "tiny-deepseek-v3",
                         "--layout", "dcp2", "--backend", "compute", "--device", "cpu",
                         "--clock", "predicted", "--concurrency", "2", "--no-loop-trace",
                         "--max-idle-s", "1", "--out", out_dir, "--json", "--no-progress")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["backend"] == "compute" and summary["requests_completed"] >= 4
    table = pd.read_parquet(out_dir / "requests.parquet")
    assert (table.output_token_ids.map(len) == table.output_tokens).all()


def test_offload_tiers_report_their_hits(capsys, tmp_path):
    trace = tmp_path / "tiny.jsonl"
    assert run(capsys, "trace", "gen", "--sessions", "3", "--seed", "1", "--tiny",
               "--out", trace)[0] == 0
    code, out, err = run(capsys, "replay", "--trace", trace, "--model", "tiny-llama",
                         "--backend", "compute", "--clock", "predicted",  # (not load-bound)
                         "--concurrency", "3", "--duration-s", "20",
                         "--num-gpu-blocks-override", "30", "--cpu-kv-gib", "0.0001",
                         "--disk-kv-gib", "0.01", "--kv-offload-dir", tmp_path / "kv",
                         "--start-part-way", "--no-progress")
    assert code == 0, err
    lines = dict(line.split() for line in out.splitlines() if line.count(" ") and
                 len(line.split()) == 2)
    assert int(lines["kv_offload_loaded_tokens"]) > 0
    assert int(lines["disk_tier_hit_blocks"]) > 0
    assert float(lines["prefix_cache_hit_rate"]) > float(lines["prefix_cache_local_hit_rate"])
    assert list((tmp_path / "kv").glob("labkit-kv-*/run-*/store-0/*.kvb"))


def test_compute_options_need_the_compute_backend(capsys, trace_file):
    code, _, err = run(capsys, "replay", "--trace", trace_file, "--model", "tiny-llama",
                       "--concurrency", "1", "--duration-s", "1", "--clock", "measured")
    assert code == 2 and "clock only apply to backend='compute'" in err


def test_bench_kernels_without_a_gpu_says_so(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the benchmark would run")
    code, out, _ = run(capsys, "bench", "kernels", "--quick")
    assert code == 0 and "CUDA" in out


def test_bench_sim_breakdown_prints_the_components_and_only_for_sim(capsys):
    code, out, _ = run(capsys, "bench", "sim", "--breakdown", "--duration-s", "3")
    assert code == 0
    for part in ("block pool", "cost model", "BlockPool.allocate", "Engine.replay"):
        assert part in out, part
    # and the kernel's share, with the page faults the replay's first writes took
    kernel = re.search(r"in the kernel: ([0-9.]+) s \(([0-9,]+) minor page faults\)", out)
    assert kernel and int(kernel.group(2).replace(",", "")) > 0, out
    code, _, err = run(capsys, "bench", "kv", "--breakdown")
    assert code == 2 and "--breakdown applies to `labkit bench sim` only" in err


def test_bench_sim_calls_prints_the_counts_and_only_for_sim(capsys):
    code, out, _ = run(capsys, "bench", "sim", "--calls", "--duration-s", "3")
    assert code == 0
    counts = re.search(r"([0-9,]+) Python calls \(([0-9.]+) a rank-step\), ([0-9,]+) built-in", out)
    assert counts and int(counts.group(1).replace(",", "")) > 1000, out
    assert "labkit/engine/" in out and "builtins.len" in out
    code, _, err = run(capsys, "bench", "kv", "--calls")
    assert code == 2 and "--calls applies to `labkit bench sim` only" in err
    code, _, err = run(capsys, "bench", "sim", "--calls", "--breakdown")
    assert code == 2 and "give one" in err


def test_bench_repeat_is_a_count_of_runs_for_sim_only(capsys):
    code, _, err = run(capsys, "bench", "sim", "--repeat", "0")
    assert code == 2 and "--repeat takes a count of runs, 1 or more" in err
    code, _, err = run(capsys, "bench", "sim", "--repeat", "2", "--breakdown")
    assert code == 2 and "not with --breakdown" in err
    code, _, err = run(capsys, "bench", "kv", "--repeat", "2")
    assert code == 2 and "--repeat applies to `labkit bench sim` only" in err


def test_bench_against_only_for_sim_and_not_with_breakdown(capsys):
    code, _, err = run(capsys, "bench", "kv", "--against", "HEAD")
    assert code == 2 and "--against applies to `labkit bench sim` only" in err
    code, _, err = run(capsys, "bench", "sim", "--against", "HEAD", "--breakdown")
    assert code == 2 and "give one" in err


def test_a_reader_gone_away_stops_the_command_quietly(trace_file):
    """`labkit ... | head`: the pipe's reader closes it; the command stops without an
    error message, as Unix tools do (exit 141, 128 + SIGPIPE)."""
    proc = subprocess.Popen([sys.executable, "-m", "labkit", "trace", "stats", str(trace_file)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # gone before anything is written
    err = proc.stderr.read().decode()
    assert proc.wait() == 141 and err == ""
