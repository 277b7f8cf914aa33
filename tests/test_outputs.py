"""Results are never lost or mixed (issue 12, items 4-7 and 13).

A results folder holds one run's three files or another's, never a mix: a writer
killed at any point of a save leaves the old run (or, past the swap, the new one); a
second writer is refused while the first holds the folder; existing results are
replaced only when asked; `summary.json` is strict JSON; a trace is written only over
a regular file; Ctrl-C during a replay says "interrupted" and leaves nothing behind.
The kills are real: a subprocess is paused inside its save and sent SIGKILL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest

from labkit.cli import main
from labkit.engine.metrics import ReplayResult

RESULTS = ["requests.parquet", "steps.parquet", "summary.json"]


def result(tag: str) -> ReplayResult:
    """A small result whose every file says which run it belongs to."""
    return ReplayResult(pd.DataFrame({"run": [tag] * 3, "x": [1.0, 2.0, 3.0]}),
                        pd.DataFrame({"run": [tag] * 2}),
                        {"run": tag, "ttft_p50_s": float("nan"), "sim_speed": float("inf")})


def strict_loads(text: str):
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def run_of(folder: Path) -> str:
    """The run the folder holds: all three files must agree (else AssertionError)."""
    assert sorted(p.name for p in folder.iterdir()) == RESULTS
    tags = {pd.read_parquet(folder / "requests.parquet")["run"].unique().item(),
            pd.read_parquet(folder / "steps.parquet")["run"].unique().item(),
            strict_loads((folder / "summary.json").read_text())["run"]}
    assert len(tags) == 1, f"a mixed results folder: {tags}"
    return tags.pop()


def save(res: ReplayResult, out: Path, overwrite: bool = True) -> None:
    try:
        res.save(out, overwrite=overwrite)
    except TypeError:  # an API without `overwrite` (it always overwrote)
        res.save(out)


def hidden_siblings(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}"))


# A writer that stops (and says so) right after writing the file named by `stage`.
PAUSED_SAVE = textwrap.dedent("""
    import sys, time
    import pandas as pd
    sys.path.insert(0, {tests!r})
    from test_outputs import result, save
    tag, out, stage = sys.argv[1:4]
    real = pd.DataFrame.to_parquet
    def paused(self, path, *args, **kwargs):
        real(self, path, *args, **kwargs)
        if stage in str(path):
            print("PAUSED", flush=True)
            time.sleep(120)
    pd.DataFrame.to_parquet = paused
    if stage == "swap":  # after the folders were exchanged, before the old one is gone
        import labkit.outputs as outputs
        exchange = outputs._exchange
        def paused_exchange(a, b):
            done = exchange(a, b)
            print("PAUSED", flush=True)
            time.sleep(120)
            return done
        outputs._exchange = paused_exchange
    save(result(tag), __import__("pathlib").Path(out))
    print("DONE", flush=True)
""").format(tests=str(Path(__file__).parent))


def start_paused_writer(tag: str, out: Path, stage: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", PAUSED_SAVE, tag, str(out), stage],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    if line != "PAUSED":
        proc.kill()
        raise AssertionError(f"the writer never paused: {line!r} {proc.stderr.read()[-800:]}")
    return proc


@pytest.mark.parametrize("stage", ["requests", "steps", "swap"])
def test_a_writer_killed_during_its_save_leaves_one_whole_run(tmp_path, stage):
    out = tmp_path / "run"
    save(result("old"), out)
    proc = start_paused_writer("new", out, stage)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    # old before the swap, new after it; never a mix, never a temp file among results
    assert run_of(out) == ("new" if stage == "swap" else "old")
    # the next writer clears what the killed one left beside the folder
    save(result("newer"), out)
    assert run_of(out) == "newer"
    assert hidden_siblings(out) == []


def test_a_first_save_killed_midway_leaves_no_results_folder(tmp_path):
    out = tmp_path / "deeper" / "run"
    proc = start_paused_writer("new", out, "steps")
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert not out.exists()


def test_a_second_writer_is_refused_while_the_first_holds_the_folder(tmp_path, capsys):
    """Two runs given one --out: the second exits 2 at once, naming the folder; the
    first's results arrive whole."""
    out = tmp_path / "run"
    first = start_paused_writer("first", out, "requests")
    try:
        trace = tmp_path / "t.jsonl"
        assert main(["trace", "gen", "--sessions", "1", "--tiny", "--out", str(trace)]) == 0
        code = main(["replay", "--trace", str(trace), "--model", "tiny-llama",
                     "--concurrency", "1", "--duration-s", "5", "--out", str(out),
                     "--overwrite", "--no-progress"])
        err = capsys.readouterr().err
        assert code == 2 and str(out) in err and "another" in err
        assert not out.exists()  # the second run wrote nothing
    finally:
        first.kill()
        first.wait(10)
    with pytest.raises(Exception, match="another labkit run"):  # an API writer too
        holder = subprocess.Popen(
            [sys.executable, "-c", PAUSED_SAVE, "held", str(out), "steps"],
            stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "PAUSED"
            result("api").save(out, overwrite=True)
        finally:
            holder.kill()
            holder.wait(10)


def test_existing_results_are_kept_unless_overwrite(tmp_path):
    out = tmp_path / "run"
    save(result("old"), out)
    with pytest.raises(Exception, match="already holds results"):
        result("new").save(out)
    assert run_of(out) == "old"
    result("new").save(out, overwrite=True)
    assert run_of(out) == "new"


def test_other_files_in_the_folder_survive_a_save(tmp_path):
    """A sweep run's folder holds its notebook; the results are swapped in beside it."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "notebook.ipynb").write_text("{}")
    (out / "figures").mkdir()
    (out / "figures" / "a.txt").write_text("a")
    result("one").save(out)
    result("two").save(out, overwrite=True)
    assert (out / "notebook.ipynb").read_text() == "{}"
    assert (out / "figures" / "a.txt").read_text() == "a"
    assert strict_loads((out / "summary.json").read_text())["run"] == "two"


def test_summary_json_is_strict_json_with_null_for_undefined_metrics(tmp_path):
    out = tmp_path / "run"
    save(result("x"), out)
    summary = strict_loads((out / "summary.json").read_text())
    assert summary["ttft_p50_s"] is None and summary["sim_speed"] is None


def test_cli_checks_out_before_anything_runs(tmp_path, capsys, monkeypatch):
    from labkit.engine import Engine

    def must_not_run(*args, **kwargs):
        raise AssertionError("the replay ran")

    trace = tmp_path / "t.jsonl"
    assert main(["trace", "gen", "--sessions", "1", "--tiny", "--out", str(trace)]) == 0
    out = tmp_path / "run"
    save(result("old"), out)
    (tmp_path / "file").write_text("x")
    monkeypatch.setattr(Engine, "replay", must_not_run)
    for target, words in ((out, "already holds results"), (tmp_path / "file", "not a directory")):
        code = main(["replay", "--trace", str(trace), "--model", "tiny-llama",
                     "--concurrency", "1", "--duration-s", "5", "--out", str(target)])
        err = capsys.readouterr().err
        assert code == 2 and words in err and "--out" in err
        assert len(err.strip().splitlines()) == 1
    assert run_of(out) == "old"
    assert hidden_siblings(out) == []


def test_cli_overwrite_replaces_results_and_json_is_strict(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    assert main(["trace", "gen", "--sessions", "1", "--tiny", "--out", str(trace)]) == 0
    out = tmp_path / "run"
    save(result("old"), out)
    capsys.readouterr()
    # 0.1 ms simulated: no call completes, so latency percentiles are undefined
    code = main(["replay", "--trace", str(trace), "--model", "tiny-llama", "--concurrency",
                 "1", "--duration-s", "0.0001", "--out", str(out), "--overwrite", "--json",
                 "--no-progress"])
    stdout = capsys.readouterr().out
    assert code == 0
    printed = strict_loads(stdout)
    saved = strict_loads((out / "summary.json").read_text())
    assert printed["ttft_p50_s"] is None and saved["ttft_p50_s"] is None
    assert saved["model"] == "tiny-llama"


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_trace_gen_writes_only_regular_files(tmp_path, capsys, kind):
    target = tmp_path / "target"
    if kind == "fifo":
        os.mkfifo(target)
    else:
        target.mkdir()
    code = main(["trace", "gen", "--sessions", "1", "--tiny", "--out", str(target)])
    err = capsys.readouterr().err
    assert code == 2 and str(target) in err and "regular file" in err
    assert (target.is_fifo() if kind == "fifo" else target.is_dir())
    assert [p.name for p in tmp_path.iterdir()] == ["target"]  # no temp file left


def test_trace_gen_refuses_a_device_before_writing(tmp_path):
    from labkit.outputs import OutDirError, check_regular_target

    with pytest.raises(OutDirError, match="a device"):
        check_regular_target("/dev/null")
    assert check_regular_target(tmp_path / "new.jsonl") == tmp_path / "new.jsonl"


INTERRUPTED_REPLAY = textwrap.dedent("""
    import sys
    from labkit.cli import main
    from labkit.engine import Engine
    step = Engine.step
    said = []
    def step_and_say(self):
        if not said:
            said.append(1)
            print("RUNNING", flush=True)
        return step(self)
    Engine.step = step_and_say
    sys.exit(main(sys.argv[1:]))
""")


def test_ctrl_c_during_a_replay_says_interrupted_and_leaves_nothing(tmp_path):
    trace = tmp_path / "t.jsonl"
    assert main(["trace", "gen", "--sessions", "4", "--seed", "1", "--out", str(trace),
                 "--param", "context_window_tokens=100000",
                 "--param", "compact_threshold_tokens=80000"]) == 0
    out = tmp_path / "deep" / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", INTERRUPTED_REPLAY, "replay", "--trace", str(trace),
         "--model", "llama-3.1-8b", "--concurrency", "4", "--duration-s", "1000000",
         "--no-sim-fast-forward", "--out", str(out), "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=ctrl_c_as_in_a_terminal)
    try:
        assert proc.stdout.readline().strip() == "RUNNING"
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()  # hygiene: a replay that missed the signal would run on for ever
    assert proc.returncode == 130
    assert err.strip() == "labkit: interrupted"
    assert not (tmp_path / "deep").exists()  # no results, no lock, no parent made for them


def ctrl_c_as_in_a_terminal() -> None:
    """In the child before exec: SIGINT as a shell's foreground job has it. A process
    inherits an *ignored* SIGINT (and Python then never raises KeyboardInterrupt), so
    whatever the test runner's worker did with it must not reach the program tested."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_without_an_atomic_exchange_a_kill_between_renames_is_repaired(tmp_path, monkeypatch):
    """Where renameat2 is missing the old folder is renamed aside, then the new one into
    place; a writer killed in between leaves the old run aside, and the next writer
    puts it back before anything else."""
    import labkit.outputs as outputs

    out = tmp_path / "run"
    save(result("old"), out)
    monkeypatch.setattr(outputs, "_exchange", lambda a, b: False)
    save(result("new"), out)  # the fallback path, start to end
    assert run_of(out) == "new" and hidden_siblings(out) == []
    out.rename(tmp_path / ".run.old-4242")  # the state a kill between the renames leaves
    with outputs.OutDir(out, overwrite=True):
        assert run_of(out) == "new"  # restored when the folder was claimed
    assert hidden_siblings(out) == []
