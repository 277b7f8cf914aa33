"""The command line's parser is lazy: `labkit --help` and a mistyped command import none
of the heavy modules (pandas, numba, the engine), and a parser built for one command
line parses it exactly as the parser of every subcommand does."""

import json
import shlex
import subprocess
import sys

import pytest

from labkit.cli import COMMANDS, build_parser, main

HEAVY = ("pandas", "numba", "labkit.engine", "labkit.traces")

# what the process prints last: the exit status, and which heavy modules it imported
PROBE = f"""
import json, sys
import labkit.cli as cli
try:
    cli.main(sys.argv[1:])
except SystemExit as stop:
    print(json.dumps([stop.code, [m for m in {HEAVY!r} if m in sys.modules]]))
"""


@pytest.mark.parametrize("argv,code,shown", [
    (["--help"], 0, "benchmarks that print figures"),
    (["nosuchcommand"], 2, "invalid choice: 'nosuchcommand'"),
])
def test_help_and_a_mistyped_command_import_nothing_heavy(argv, code, shown):
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True,
                          text=True, check=True)
    assert shown in done.stdout + done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == [code, []]


COMMAND_LINES = [  # from README.md, docs/ and tests/
    "trace gen --kind agentx --sessions 16 --seed 0 --out runs/agentx16.jsonl",
    "trace gen --sessions 4 --seed 1 --tiny --out runs/tiny.jsonl "
    "--param context_window_tokens=200000 --param compact_threshold_tokens=150000",
    "trace gen --kind random --num-prompts 1000 --input-len 1024 --output-len 128 "
    "--range-ratio 0.2 --request-rate 8 --burstiness 0.5 --out runs/random.jsonl",
    "trace gen --kind multi-turn --sessions 200 --turns 8 --input-len 300 "
    "--think-time-s 5 --request-rate 1 --out runs/chat.jsonl",
    "trace stats runs/agentx16.jsonl",
    "trace stats trace.jsonl --window 0:600 --speedup 2 --json",
    "trace convert BurstGPT_1.csv gpt4.jsonl --where Model=GPT-4 --where 'Response tokens>0'",
    "replay --trace runs/agentx16.jsonl --model deepseek-v3 --layout dep16 --hardware h200 "
    "--concurrency 16 --duration-s 600 --warmup-s 120 --router session_sticky "
    "--num-speculative-tokens 3 --acceptance-length 2.99 --max-model-len 1048576 "
    "--out runs/dep16 --timeline runs/dep16/timeline.json.gz",
    "replay --trace runs/chat.jsonl --model llama-3.1-8b --open-loop --slo ttft=2,tpot=0.05 "
    "--percentiles 50,90,99 --gpu-hour-usd 3.5 --on-oversize skip",
    "replay --trace runs/tiny.jsonl --model tiny-deepseek-v3 --layout dcp2 --backend compute "
    "--device cpu --clock predicted --concurrency 4 --no-loop-trace --max-idle-s 1 "
    "--num-gpu-blocks 30 --cpu-kv-gib 0.0001 --no-enable-chunked-prefill --json --no-progress",
    "capacity --model deepseek-v3 --layout tp8,tp8xdcp8,dep16 --hardware h200 "
    "--context 1000000 --kv-dtype fp8 --json",
    "sweep notebooks/experiments/agentx_replay.ipynb -p layout tp1,tp2 -p concurrency 2,8 "
    "--out runs/sweep --jobs 2 --resume",
    "pd profile --trace runs/agentx16.jsonl --model llama-3.1-8b --prefill-layouts tp2,pcp2 "
    "--decode-layouts tp1,dp2 --duration-s 60 --out runs/pd",
    "pd sweep --trace runs/agentx16.jsonl --model llama-3.1-8b --prefill-layout tp2 "
    "--decode-layout tp1 --max-groups 4 --duration-s 60 --out runs/pd --max-num-seqs 64",
    "plan --trace T --model qwen3-30b-a3b --hardware h200 --gpus 8 --slo ttft=2,tpot=0.05 "
    "--concurrency 16,64 --duration-s 600 --layouts tp2,dep4,dep8 --no-pd "
    "--max-num-batched-tokens 2048,8192 --executor ray --ray-address auto --out runs/plan",
    "validate --data ../shared/data --json --duration-scale 0.5 --run a --run b",
    "lab",
    "bench sim --quick --against HEAD --repeat 3",
]


@pytest.fixture(scope="module")
def eager():
    return build_parser()


@pytest.mark.parametrize("line", COMMAND_LINES)
def test_a_command_line_parses_as_with_every_subcommand_built(line, eager):
    argv = shlex.split(line)
    assert vars(build_parser(argv).parse_args(argv)) == vars(eager.parse_args(argv))


@pytest.mark.parametrize("name", [c.name for c in COMMANDS])
def test_a_subcommand_built_alone_is_the_one_built_with_all(name, eager):
    """Its whole interface: every flag, default, choice and help line."""
    def help_of(parser):
        return next(a for a in parser._actions if a.dest == "command").choices[name] \
            .format_help()

    assert help_of(build_parser([name])) == help_of(eager)


def test_the_top_level_help_lists_every_subcommand_with_its_help(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # (argparse wraps the help lines)
    assert "{" + ",".join(c.name for c in COMMANDS) + "}" in text
    places = [text.index(f" {c.name} {' '.join(c.help.split())}") for c in COMMANDS]
    assert places == sorted(places)


def test_a_mistyped_command_exits_2_listing_the_commands(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["replya", "--trace", "t.jsonl"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("labkit: error: argument command: invalid choice: 'replya'")
    assert all(c.name in err.split("choose from")[1] for c in COMMANDS)


def test_a_malformed_trace_exits_2_and_another_value_error_propagates(monkeypatch, capsys):
    """main() catches TraceError without importing labkit.traces up front."""
    import labkit.cli
    from labkit.traces.validate import TraceError

    def fail(error):
        def run(args):
            raise error
        return run

    monkeypatch.setattr(labkit.cli, "_run", fail(TraceError("t.jsonl", 2, "no output_length")))
    assert main(["bench", "sim"]) == 2
    assert capsys.readouterr().err == "labkit: error: t.jsonl:2: no output_length\n"
    monkeypatch.setattr(labkit.cli, "_run", fail(ValueError("a bug")))
    with pytest.raises(ValueError, match="a bug"):
        main(["bench", "sim"])
