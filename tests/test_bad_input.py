"""Every bad input is one line on stderr and exit 2, in bounded time and memory.

Issue 12, items 10-12: values that made a run never end or grow without bound, that
gave a traceback, or that were silently accepted as nonsense. Each case runs the CLI
in-process (a SIGALRM fails a case that hangs) and must exit 2 with one line naming
the knob, before anything is written. The cases that used to eat memory run in a
subprocess with an address-space limit, and their peak memory is read back with
`os.wait4`. What can be bounded is bounded instead of refused: a pool of 10^12 blocks
or of 1-token blocks on a tiny model costs only the blocks a run touches.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys

import pytest

from labkit.cli import main

SECONDS = 60  # far above what any of these needs; a hang fails instead of blocking


@contextlib.contextmanager
def deadline(seconds: int = SECONDS):
    def expired(*_):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    folder = tmp_path_factory.mktemp("traces")
    agentx, tiny = folder / "agentx.jsonl.gz", folder / "tiny.jsonl"
    assert main(["trace", "gen", "--sessions", "4", "--seed", "1", "--out", str(agentx),
                 "--param", "context_window_tokens=100000",
                 "--param", "compact_threshold_tokens=80000"]) == 0
    assert main(["trace", "gen", "--sessions", "2", "--seed", "1", "--tiny",
                 "--out", str(tiny)]) == 0
    (folder / "not.safetensors").write_text("this is not a checkpoint\n" * 100)
    return {"agentx": str(agentx), "tiny": str(tiny), "folder": folder}


def replay(trace: str = "agentx", *flags: str) -> list[str]:
    return ["replay", "--trace", f"{{{trace}}}", "--model", "llama-3.1-8b", *flags]


def tiny_replay(*flags: str) -> list[str]:
    return ["replay", "--trace", "{tiny}", "--model", "tiny-llama", *flags]


PD = ["--trace", "{agentx}", "--model", "llama-3.1-8b", "--concurrency", "2"]
GEN = ["trace", "gen", "--sessions", "2", "--out", "{folder}/new.jsonl"]

REFUSED = {  # name: (argv, words stderr must hold)
    "duration nan": (replay("agentx", "--concurrency", "4", "--duration-s", "nan"),
                     ["--duration-s", "nan"]),
    "duration inf": (replay("agentx", "--concurrency", "4", "--duration-s", "inf"),
                     ["--duration-s", "inf"]),
    "duration negative": (replay("agentx", "--concurrency", "4", "--duration-s", "-5"),
                          ["--duration-s", "-5"]),
    "warmup negative": (replay("agentx", "--concurrency", "4", "--duration-s", "10",
                               "--warmup-s", "-5"), ["--warmup-s"]),
    "warmup nan": (replay("agentx", "--concurrency", "4", "--duration-s", "10",
                          "--warmup-s", "nan"), ["--warmup-s"]),
    "warmup past the end": (replay("agentx", "--concurrency", "4", "--duration-s", "10",
                                   "--warmup-s", "10"), ["--warmup-s", "--duration-s"]),
    "max idle nan": (replay("agentx", "--concurrency", "4", "--duration-s", "10",
                            "--max-idle-s", "nan"), ["--max-idle-s"]),
    "seed negative": (replay("agentx", "--concurrency", "4", "--duration-s", "10",
                             "--seed", "-1"), ["seed"]),
    "cpu tier nan": (replay("agentx", "--concurrency", "4", "--duration-s", "10",
                            "--cpu-kv-gib", "nan"), ["cpu_kv_gib"]),
    "utilization nan": (replay("agentx", "--concurrency", "4", "--duration-s", "10",
                               "--gpu-memory-utilization", "nan"), ["gpu_memory_utilization"]),
    "offload dir on sim": (replay("agentx", "--concurrency", "4", "--duration-s", "10",
                                  "--cpu-kv-gib", "1", "--kv-offload-dir", "{folder}/kv"),
                           ["kv_offload_dir", "compute"]),
    "too many layout gpus": (replay("agentx", "--concurrency", "4", "--duration-s", "10",
                                    "--layout", "dp100000"), ["dp100000", "GPUs"]),
    "checkpoint not safetensors": (
        tiny_replay("--backend", "compute", "--checkpoint", "{folder}/not.safetensors",
                    "--concurrency", "1", "--duration-s", "1"), ["checkpoint", "not.safetensors"]),
    "gen block size negative": (GEN + ["--block-size", "-4"], ["--block-size"]),
    "gen block size zero": (GEN + ["--block-size", "0"], ["--block-size"]),
    "gen share above one": (GEN + ["--param", "subagent_session_share=5"],
                            ["subagent_session_share"]),
    "gen window negative": (GEN + ["--param", "context_window_tokens=-5"],
                            ["context_window_tokens"]),
    "gen calls negative": (GEN + ["--param", "main_calls_median=-3"], ["main_calls_median"]),
    "gen median nan": (GEN + ["--param", "output_median=nan"], ["output_median"]),
    "pd sweep duration nan": (["pd", "sweep", *PD, "--prefill-layout", "tp1", "--decode-layout",
                               "tp1", "--ratios", "1:1", "--duration-s", "nan"],
                              ["--duration-s"]),
    "pd profile duration inf": (["pd", "profile", *PD[:4], "--prefill-layouts", "tp1",
                                 "--duration-s", "inf"], ["--duration-s"]),
    "pd sweep huge ratio": (["pd", "sweep", *PD, "--prefill-layout", "tp1", "--decode-layout",
                             "tp1", "--ratios", "1:1000000", "--duration-s", "5"],
                            ["ratio", "1:1000000"]),
    "pd profile pcp decode": (["pd", "profile", *PD[:4], "--decode-layouts", "pcp2",
                               "--concurrency", "1", "--duration-s", "5"],
                              ["decode layout", "pcp2"]),
}


def expand(argv: list[str], traces: dict) -> list[str]:
    return [a.format(**{k: str(v) for k, v in traces.items()}) for a in argv]


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_bad_value_is_one_line_and_exit_2_before_anything_runs(traces, capsys, case):
    argv, words = REFUSED[case]
    argv = expand(argv, traces)
    out_dir = traces["folder"] / f"never-{case.replace(' ', '-')}"
    if argv[0] in ("replay", "pd"):
        argv += ["--out", str(out_dir)]
    with deadline():
        code = main(argv)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2, captured.err[-2000:]
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err[-2000:]
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert not out_dir.exists() and captured.out == ""
    assert not (traces["folder"] / "new.jsonl").exists()


@pytest.mark.parametrize("argv, words", [
    (["replay", "--trace", "t", "--model", "m", "--concurrency", "1.5"],
     ["--concurrency", "invalid int value: '1.5'"]),
    (["replay", "--trace", "t", "--model", "m", "--num-gpu-blocks", "1e12",
      "--concurrency", "1"], ["--num-gpu-blocks", "'1e12'"]),
    (["trace", "gen", "--sessions", "two", "--out", "x"], ["--sessions"]),
    (["replay", "--model", "m", "--concurrency", "1"], ["--trace"]),
])
def test_a_flag_argparse_refuses_is_one_line_too(capsys, argv, words):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(lines) == 1
    for word in words:
        assert word in lines[0]


SWEEP_NOTEBOOK = "notebooks/experiments/agentx_replay.ipynb"


@pytest.mark.parametrize("value, words", [("abc", ["concurrency", "'abc'", "int"]),
                                          ("1.5", ["concurrency", "1.5", "int"]),
                                          ("True", ["concurrency", "True", "int"])])
def test_a_sweep_value_of_the_wrong_type_is_refused_before_any_run(tmp_path, capsys, value,
                                                                   words):
    from pathlib import Path

    notebook = Path(__file__).resolve().parents[1] / SWEEP_NOTEBOOK
    out = tmp_path / "sweep"
    with deadline():
        code = main(["sweep", str(notebook), "-p", "concurrency", f"2,{value}",
                     "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    for word in words:
        assert word in err[0], (word, err[0])
    assert not out.exists()


# ----------------------------------------------------------- bounded memory
# The peak is VmHWM of /proc/self/status: it belongs to the memory map exec made, whereas
# ru_maxrss also counts the forked parent's pages held before exec (the test worker's).
PEAK = "import runpy, sys; sys.argv = ['labkit'] + sys.argv[1:]\n" \
       "try:\n    runpy.run_module('labkit.cli', run_name='__main__')\n" \
       "finally:\n    hwm = [l.split()[1] for l in open('/proc/self/status') " \
       "if l.startswith('VmHWM')]\n    print('PEAK_KIB', hwm[0], file=sys.stderr)"


def run_measured(argv: list[str], limit_gib: float = 6.0, timeout: float = 120):
    """`labkit ARGV` in a subprocess under an address-space limit: (exit code, stdout,
    stderr, the run's own peak resident memory in GiB, which it reports on exit)."""
    def limit():
        cap = int(limit_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    proc = subprocess.Popen([sys.executable, "-c", PEAK, *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=limit)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError(f"labkit {' '.join(argv)} ran past {timeout} s") from None
    lines = err.strip().splitlines()
    peak = next((int(line.split()[1]) for line in lines if line.startswith("PEAK_KIB")), None)
    err = "\n".join(line for line in lines if not line.startswith("PEAK_KIB"))
    return proc.returncode, out, err, (peak or 0) / 2**20


def test_a_huge_concurrency_is_refused_naming_the_knob(traces):
    code, _, err, peak = run_measured(expand(replay("agentx", "--concurrency", "1000000000",
                                                    "--duration-s", "10"), traces))
    assert code == 2 and len(err.splitlines()) == 1 and "--concurrency" in err, err[-2000:]
    assert peak < 1.0


@pytest.mark.parametrize("flags, blocks", [
    (["--num-gpu-blocks", "1000000000000"], 10**12),      # 10^12 blocks
    (["--model", "tiny-llama", "--block-size", "1"], 10**8),  # 485 million 1-token blocks
    (["--layout", "dp1000"], 50_000),                       # 1,000 pools of 51,572 blocks
])
def test_a_huge_block_pool_costs_only_the_blocks_a_run_touches(traces, flags, blocks):
    argv = expand(replay("agentx", "--concurrency", "2", "--duration-s", "5", "--json",
                         "--no-progress"), traces)
    if flags[0] == "--model":
        argv = [a if a != "llama-3.1-8b" else flags[1] for a in argv] + flags[2:]
        argv[argv.index("--trace") + 1] = str(traces["tiny"])
    else:
        argv += flags
    code, out, err, peak = run_measured(argv)
    assert code == 0, err[-2000:]
    summary = json.loads(out)
    assert summary["requests_completed"] > 0
    assert summary["num_gpu_blocks_per_rank"] >= blocks
    assert peak < 1.0  # GiB


def test_no_traceback_leaks_from_a_bad_value_on_the_console_script(traces):
    code, out, err, _ = run_measured(expand(replay("agentx", "--concurrency", "4",
                                                   "--duration-s", "nan"), traces))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert os.path.exists(traces["agentx"])
