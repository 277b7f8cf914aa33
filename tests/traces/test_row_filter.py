"""`--where`: a CSV trace read as if it held only the rows meeting the conditions
(`formats/row_filter.py`) — the rows pandas keeps for the same conditions, the same
trace by columns and by rows, sessions chained over the kept rows, errors named."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import random

import numpy as np
import pandas as pd
import pytest

from labkit.cli import main
from labkit.errors import ConfigError
from labkit.traces import TraceError, load_trace
from labkit.traces.formats import burstgpt, csv_columns
from labkit.traces.formats.row_filter import parse_condition

HEADER = ["Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens",
          "Log Type"]


def _burstgpt_text(rng: random.Random, rows: int, bad_cells: bool = False) -> str:
    """A BurstGPT-like file: two models, two log types, failed requests (0 and 0.0);
    ``bad_cells``: now and then a 'Response tokens' cell that is not a number."""
    lines = [",".join(HEADER)]
    for i in range(rows):
        tokens_out = rng.choice(["0", "0.0", str(rng.randint(1, 400)), str(rng.randint(1, 9))])
        if bad_cells and rng.random() < 0.02:
            tokens_out = rng.choice(["n/a", "", "inf"])
        tokens_in = rng.randint(1, 3000)
        lines.append(f"{i * 0.7 + rng.random():.3f},{rng.choice(['ChatGPT', 'GPT-4'])},"
                     f"{tokens_in},{tokens_out},{tokens_in + 1},"
                     f"{rng.choice(['Conversation log', 'API log'])}")
    return "\n".join(lines) + "\n"


def _pandas_keeps(text: str, conditions: list[str]) -> list[int]:
    """The file lines of the rows pandas keeps (vLLM's BurstGPT loader's way: string
    columns compared as text, token columns as numbers)."""
    df = pd.read_csv(io.StringIO(text))
    keep = pd.Series(True, index=df.index)
    for text_condition in conditions:
        c = parse_condition(text_condition)
        column = df[c.column]
        value = c.number if c.number is not None else c.value
        keep &= {"=": column == value, "!=": column != value, ">": column > value,
                 ">=": column >= value, "<": column < value, "<=": column <= value}[c.op]
    return [i + 2 for i in np.flatnonzero(keep.to_numpy())]


FILTERS = [["Model=GPT-4", "Response tokens>0"],  # vLLM's `--dataset-name burstgpt`
           ["Model!=GPT-4"], ["Response tokens=0"], ["Log Type = API log"],
           ["Request tokens>=1000", "Request tokens<2000"], ["Response tokens<=5"],
           ["Response tokens<9"], ["Response tokens>9"],
           ["Model==ChatGPT", "Log Type!=API log", "Response tokens>3"]]


@pytest.mark.parametrize("conditions", FILTERS, ids=" and ".join)
def test_the_rows_kept_are_those_pandas_keeps(tmp_path, conditions):
    text = _burstgpt_text(random.Random(len(conditions)), 300)
    path = tmp_path / "bg.csv"
    path.write_text(text)
    expected = _pandas_keeps(text, conditions)
    assert 0 < len(expected) < 300  # the filter decides something
    rows = pd.read_csv(io.StringIO(text))
    trace = load_trace(path, where=conditions)
    with csv_columns.rows_only():
        by_rows = load_trace(path, where=conditions)
    assert trace.requests == by_rows.requests  # block ids too
    assert [r.request_id for r in trace.requests] == [f"bg-{line}" for line in expected]
    assert [r.input_length for r in trace.requests] == \
        [int(rows["Request tokens"][line - 2]) for line in expected]
    assert [r.output_length for r in trace.requests] == \
        [max(int(rows["Response tokens"][line - 2]), 1) for line in expected]
    assert [r.timestamp for r in trace.requests] == \
        [float(rows["Timestamp"][line - 2]) for line in expected]


def test_random_filters_read_the_same_trace_or_error_both_ways(monkeypatch, tmp_path):
    """Files with cells a numeric condition cannot read: where the conditions before it
    drop those rows, both readers load the file; where not, both name the line."""
    real, taken = burstgpt._by_columns, []

    def spy(*args):
        taken.append(real(*args))
        return taken[-1]

    monkeypatch.setattr(burstgpt, "_by_columns", spy)
    rng, path = random.Random(6), tmp_path / "bg.csv"
    loaded = refused = 0
    pool = [c for conditions in FILTERS for c in conditions]
    for _ in range(120):
        path.write_text(_burstgpt_text(rng, rng.randint(1, 40), bad_cells=True))
        where = rng.sample(pool, rng.randint(1, 3))
        outcomes = []
        for rows_only in (False, True):  # by columns where it can, then by rows only
            try:
                with csv_columns.rows_only() if rows_only else contextlib.nullcontext():
                    outcomes.append(load_trace(path, where=where).requests)
            except (TraceError, ConfigError) as e:
                outcomes.append(f"{type(e).__name__}: {e}")
        assert outcomes[0] == outcomes[1], (where, path.read_text())
        loaded += not isinstance(outcomes[0], str)
        refused += isinstance(outcomes[0], str) and "is not a number" in outcomes[0]
    by_columns = sum(t is not None for t in taken)
    assert loaded > 30 and refused > 5 and by_columns > 20


def test_a_session_chains_its_kept_rows(tmp_path):
    path = tmp_path / "s.csv"
    path.write_text("Timestamp,Session ID,Model,Request tokens,Response tokens\n"
                    "1,a,GPT-4,100,5\n2,a,ChatGPT,100,5\n4,a,GPT-4,300,0\n7,a,GPT-4,400,6\n"
                    "8,,GPT-4,50,5\n")
    trace = load_trace(path, where=["Model=GPT-4", "Response tokens>0"])
    assert [(r.request_id, r.parent_id, r.delay_s, r.session_id) for r in trace.requests] == [
        ("bg-2", None, 0.0, "bg-sa"), ("bg-5", "bg-2", 6.0, "bg-sa"),
        ("bg-6", None, 0.0, "bg-6")]
    with csv_columns.rows_only():
        assert load_trace(path, where=["Model=GPT-4", "Response tokens>0"]).requests == \
            trace.requests


def test_azure_clock_starts_at_the_first_kept_row_and_splitwise_copies(tmp_path):
    azure = tmp_path / "az.csv"
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2024-05-10 00:00:00.000000+00:00,9000,4\n"
                     "2024-05-10 00:00:01.500000+00:00,100,4\n"
                     "2024-05-10 00:00:04.000000+00:00,200,4\n")
    trace = load_trace(azure, where="ContextTokens<8192")
    assert [(r.request_id, r.timestamp) for r in trace.requests] == \
        [("az-3", 0.0), ("az-4", 2.5)]
    splitwise = tmp_path / "sw.csv"
    splitwise.write_text("request_id,request_type,arrival_timestamp,batch_size,prompt_size,"
                         "token_size\n0,1,0.5,2,100,5\n1,2,0.7,1,200,5\n2,1,0.9,1,300,5\n")
    for rows_only in (False, True):
        with csv_columns.rows_only() if rows_only else contextlib.nullcontext():
            kept = load_trace(splitwise, where="request_type=1")
        assert [r.request_id for r in kept.requests] == ["sw-0.0", "sw-0.1", "sw-2"]


@pytest.mark.parametrize("where, error, words", [
    ("Model", ConfigError, ["no comparison", "NAME=VALUE"]),
    ("=GPT-4", ConfigError, ["a name and a value"]),
    ("Response tokens>many", ConfigError, ["> compares numbers", "'many'"]),
    ("Modell=GPT-4", TraceError, [":1:", "'Modell'", "the header has 'Timestamp'"]),
    ("Model=Claude", ConfigError, ["none of the 3 rows", "'Model=Claude'"]),
    ("Model>3", TraceError, [":2:", "'ChatGPT' is not a number"]),
])
def test_bad_filters_are_named(tmp_path, where, error, words):
    path = tmp_path / "bg.csv"
    path.write_text("Timestamp,Model,Request tokens,Response tokens\n1,ChatGPT,10,1\n"
                    "2,GPT-4,10,1\n3,GPT-4,10,1\n")
    for rows_only in (False, True):
        with csv_columns.rows_only() if rows_only else contextlib.nullcontext():
            with pytest.raises(error) as caught:
                load_trace(path, where=where)
        for word in words:
            assert word in str(caught.value)


BAILIAN = [  # (chat_id, parent, time, type, turn, ids): two conversations
    (1, -1, 0.5, "text", 1, [1, 2, 3]), (2, 1, 2.0, "image", 2, [1, 2, 3, 4, 5]),
    (3, 2, 3.0, "text", 3, [1, 2, 3, 4, 5, 6, 7]), (4, -1, 3.5, "search", 1, [30, 31]),
    (5, 4, 6.0, "text", 2, [30, 31, 32]), (6, 5, 9.0, "text", 3, [30, 31, 32, 33])]


def _bailian_line(chat, parent, t, kind, turn, ids) -> str:
    return json.dumps({"chat_id": chat, "parent_chat_id": parent, "timestamp": t,
                       "input_length": 16 * len(ids) - 3, "output_length": 7, "type": kind,
                       "turn": turn, "hash_ids": ids}) + "\n"


@pytest.mark.parametrize("where, kept", [
    ("type=text", [1, 3, 5, 6]), ("type!=text", [2, 4]), (["turn>=2", "turn<3"], [2, 5]),
    ("parent_chat_id=-1", [1, 4]), ("timestamp>3", [4, 5, 6]), ("turn=3.0", [3, 6])])
def test_a_filtered_json_trace_is_the_file_of_its_kept_lines(tmp_path, where, kept):
    """Bailian: as if the file held only the kept turns (a turn whose parent is dropped
    starts a conversation); Mooncake likewise, lines renamed aside."""
    whole, part = tmp_path / "all.jsonl", tmp_path / "part.jsonl"
    whole.write_text("".join(_bailian_line(*row) for row in BAILIAN))
    part.write_text("".join(_bailian_line(*row) for row in BAILIAN if row[0] in kept))
    assert load_trace(whole, where=where).requests == load_trace(part).requests
    # Mooncake: the same calls as its lines, and a filter on its fields
    def mooncake(rows) -> str:
        return "".join(json.dumps({"timestamp": int(t * 1000), "input_length": 512 * len(ids)
                                   - 3, "output_length": 7 + chat, "hash_ids": ids}) + "\n"
                       for chat, _, t, _, _, ids in rows)

    cut = ["timestamp>=1000", "input_length>1100"]
    whole.write_text(mooncake(BAILIAN))
    part.write_text(mooncake([r for r in BAILIAN if r[2] >= 1 and 512 * len(r[5]) - 3 > 1100]))
    assert [dataclasses.replace(r, request_id="", session_id="")
            for r in load_trace(whole, where=cut).requests] == \
        [dataclasses.replace(r, request_id="", session_id="")
         for r in load_trace(part).requests]
    assert [r.request_id for r in load_trace(whole, where=cut).requests] == \
        ["mc-2", "mc-3", "mc-5", "mc-6"]  # (the names of their lines in the whole file)


def test_json_filters_name_what_they_cannot_read(tmp_path):
    from labkit.traces import generate_random_trace, write_trace

    path = tmp_path / "bl.jsonl"
    path.write_text("".join(_bailian_line(*row) for row in BAILIAN))
    for where, words in [("typ=text", [":1:", "no field 'typ'", "'type', 'turn'"]),
                         ("type>2", [":1:", "'type': 'text' is not a number"]),
                         ("type=video", ["none of the 6 rows"])]:
        with pytest.raises((TraceError, ConfigError)) as caught:
            load_trace(path, where=where)
        for word in words:
            assert word in str(caught.value)
    labkit = tmp_path / "t.jsonl"  # sessions hang together: no filter
    write_trace(generate_random_trace(num_prompts=3, seed=0), labkit)
    with pytest.raises(ConfigError, match="flat rows .*is a labkit trace"):
        load_trace(labkit, where="input_length>3")


def test_the_commands_take_the_filter(tmp_path, capsys):
    text = _burstgpt_text(random.Random(3), 200)
    path, out = tmp_path / "bg.csv", tmp_path / "part.jsonl"
    path.write_text(text)
    vllm = ["Model=GPT-4", "Response tokens>0"]
    flags = [part for c in vllm for part in ("--where", c)]
    assert main(["trace", "stats", str(path), "--json", *flags]) == 0
    printed, kept = capsys.readouterr(), len(_pandas_keeps(text, vllm))
    assert json.loads(printed.out)["requests"] == kept
    assert f"--where 'Model=GPT-4' and 'Response tokens>0': {kept} of the 200 rows kept" \
        in printed.err
    assert main(["trace", "convert", str(path), str(out), *flags, "--window", "10:"]) == 0
    part = load_trace(out)
    assert [r.request_id for r in part.requests] == [
        f"bg-{line}" for line in _pandas_keeps(text, vllm)
        if float(pd.read_csv(io.StringIO(text))["Timestamp"][line - 2]) >= 10]
    bad = tmp_path / "bad.jsonl"  # refused before anything is written
    assert main(["trace", "convert", str(path), str(bad), "--where", "Model"]) == 2
    assert "--where 'Model': no comparison" in capsys.readouterr().err and not bad.exists()
