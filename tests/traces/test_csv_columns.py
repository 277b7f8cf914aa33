"""The CSV formats read a column at a time (`formats/csv_columns.py`) load exactly what
the row reader loads, and leave every file they would read otherwise to it: random
files, plain and damaged, give the same trace or the same error both ways."""
from __future__ import annotations

import random

import pytest

from labkit.traces import TraceError, load_trace
from labkit.traces.formats import azure, burstgpt, splitwise

FIXTURES = __import__("pathlib").Path(__file__).parent / "fixtures"
MODULES = {"azure": azure, "burstgpt": burstgpt, "splitwise": splitwise}
COLUMN_READERS = {fmt: module._by_columns for fmt, module in MODULES.items()}


def _both_ways(monkeypatch, path, fmt):
    """(outcome by columns, outcome by rows, did the column reader load it?); an
    outcome is the trace's requests or the error's text."""
    module, taken = MODULES[fmt], []
    by_columns = COLUMN_READERS[fmt]

    def spy(*args):
        taken.append(by_columns(*args))
        return taken[-1]

    outcomes = []
    for reader in (spy, lambda *args: None):
        monkeypatch.setattr(module, "_by_columns", reader)
        try:
            trace = load_trace(path, format=fmt)
            outcomes.append((trace.requests, trace.max_hash_id,
                             [type(r.input_length) for r in trace.requests]))
        except TraceError as e:
            outcomes.append(str(e))
    return outcomes[0], outcomes[1], taken[0] is not None


@pytest.mark.parametrize(("name", "fmt"), [
    ("azure_2023.csv", "azure"), ("azure_2024.csv", "azure"), ("burstgpt.csv", "burstgpt"),
    ("burstgpt_sessions.csv", "burstgpt"), ("splitwise.csv", "splitwise")])
def test_published_fixtures_load_by_columns_as_by_rows(monkeypatch, name, fmt):
    by_columns, by_rows, columns_loaded = _both_ways(monkeypatch, FIXTURES / name, fmt)
    assert columns_loaded and by_columns == by_rows


def _number(rng: random.Random, whole: bool) -> str:
    pick = rng.random()
    if pick < 0.93:
        value = rng.randint(1, 5000)
        return str(value) if whole or rng.random() < 0.5 else f"{value / 8}"
    return rng.choice(["0", "-3", "12.0", " 7 ", "1e3", "2.5", "nan", "inf", "", "x1",
                       "1_000", "500000000", "2000000000000", str(2**53 + 1), "9" * 30,
                       "0x10", "-0.0"])


def _stamp(rng: random.Random, second: float) -> str:
    day = f"2024-05-10 {int(second // 3600):02d}:{int(second % 3600 // 60):02d}:"
    if rng.random() < 0.95:
        if rng.random() < 0.5:   # 2023: naive, 7 digits
            return f"{day}{second % 60:010.7f}"
        return f"{day}{second % 60:09.6f}{rng.choice(['+00:00', '+02:00', '-07:30'])}"
    return rng.choice(["2023-13-01 00:00:00", "garbage", "2023-11-16T18:17:03",
                       "2023-11-16 18:17:03Z", "2023-11-16 24:00:00", "2023-11-16",
                       "2023-11-16 18:17:03.12345678", "2023-02-30 01:00:00",
                       "2023-11-16 18:17:03.5 ", " 2023-11-16 18:17:03.5"])


def _row(rng, fmt, i, columns):
    t = i * rng.choice([0.25, 1.5, 0.013]) + rng.random()
    cells = {"TIMESTAMP": _stamp(rng, t), "Timestamp": f"{t:.3f}" if rng.random() < 0.9
             else _number(rng, False), "ContextTokens": _number(rng, True),
             "GeneratedTokens": _number(rng, True), "Request tokens": _number(rng, True),
             "Response tokens": _number(rng, True), "arrival_timestamp": f"{t:.4f}",
             "prompt_size": _number(rng, True), "token_size": _number(rng, True),
             "Session ID": rng.choice(["", "a", "b", " c", "17"]),
             "request_id": rng.choice([str(i), str(i), "", str(rng.randint(0, 5))]),
             "batch_size": rng.choice(["1", "1", "2", "", "0", "1.5"]),
             "Model": "ChatGPT", "Log Type": "Conversation log"}
    return [cells.get(c, "x") for c in columns]


HEADERS = {
    "azure": ["TIMESTAMP", "ContextTokens", "GeneratedTokens"],
    "burstgpt": ["Timestamp", "Model", "Request tokens", "Response tokens", "Log Type"],
    "splitwise": ["request_id", "arrival_timestamp", "prompt_size", "token_size"],
}
QUOTABLE = ("Session ID", "request_id", "Model", "Log Type")
OPTIONAL = {"azure": [], "burstgpt": ["Session ID"], "splitwise": ["batch_size"]}


def _random_file(rng: random.Random, fmt: str) -> str:
    columns = list(HEADERS[fmt]) + [c for c in OPTIONAL[fmt] if rng.random() < 0.5]
    if fmt == "splitwise" and rng.random() < 0.3:
        columns.remove("request_id")
    rng.shuffle(columns)
    rows = [_row(rng, fmt, i, columns) for i in range(rng.randint(0, 6))]
    lines = [", ".join(columns) if rng.random() < 0.2 else ",".join(columns)]
    quote = rng.random() < 0.1   # names quoted (the row reader reads them unquoted)
    lines += [",".join(f'"{cell}"' if quote and name in QUOTABLE else cell
                       for name, cell in zip(columns, cells, strict=True)) for cells in rows]
    damage = rng.random()
    if damage < 0.06 and len(lines) > 1:
        lines.insert(rng.randint(1, len(lines)), "")              # a blank row
    elif damage < 0.12 and len(lines) > 1:
        lines[-1] += ",extra"                                     # a ragged row
    elif damage < 0.16:
        lines[0] = lines[0].replace(columns[0], columns[-1], 1)   # a repeated column
    elif damage < 0.20 and len(lines) > 1:
        lines[1] = '"' + lines[1].replace(",", '","') + '"'       # quoted cells
    elif damage < 0.23:
        lines[0] = "\ufeff" + lines[0]                             # a byte-order mark
    elif damage < 0.26:
        lines[0] = lines[0].replace(HEADERS[fmt][1], "Nope")       # a missing column
    end = rng.choice(["\n", "\n", "\n", "\r\n"])
    return end.join(lines) + (end if rng.random() < 0.7 else "")


@pytest.mark.parametrize("fmt", sorted(MODULES))
def test_random_files_give_the_same_trace_or_error_both_ways(monkeypatch, tmp_path, fmt):
    from labkit.traces.formats import csv_columns

    monkeypatch.setattr(csv_columns, "CHUNK_ROWS", 2)  # rows cut into cells 2 at a time
    rng = random.Random(20261206)
    path = tmp_path / "trace.csv"
    loaded = refused = 0
    for _ in range(400):
        path.write_bytes(_random_file(rng, fmt).encode())
        by_columns, by_rows, columns_loaded = _both_ways(monkeypatch, path, fmt)
        assert by_columns == by_rows, path.read_text()
        loaded += columns_loaded
        refused += isinstance(by_rows, str)
    assert loaded > 40 and refused > 40   # both kinds of file were met, often


def _cut(path, fmt, window, early: bool):
    """select(..., window) of the file loaded whole, or with the loader told the window."""
    from labkit.traces import select
    from labkit.traces.formats import load

    try:
        trace = select(load(path, fmt, window=window if early else None), window=window)
        return trace.requests, trace.max_hash_id
    except (TraceError, ValueError) as e:
        return f"{type(e).__name__}: {e}"


def test_a_window_told_to_the_loader_cuts_the_same_part(tmp_path):
    """The CSV loaders leave out what a window will (`csv_columns.in_window`); the part
    is the same, block ids included, as cutting the whole file — and less was built."""
    from labkit.traces.formats import load

    rng = random.Random(11)
    path = tmp_path / "trace.csv"
    left_out = 0
    for fmt in sorted(MODULES):
        for _ in range(150):
            path.write_bytes(_random_file(rng, fmt).encode())
            start = rng.choice([0.0, 0.5, 1.0, 2.0])
            window = (start, start + rng.choice([0.4, 1.0, 3.0]))
            assert _cut(path, fmt, window, True) == _cut(path, fmt, window, False), \
                path.read_text()
            try:
                left_out += len(load(path, fmt, window=window)) < len(load(path, fmt))
            except (TraceError, ValueError):
                pass
    assert left_out > 50
    # a session (BurstGPT's Session ID) is kept whole: its later calls too
    sessions = tmp_path / "s.csv"
    sessions.write_text("Timestamp,Model,Request tokens,Response tokens,Session ID\n"
                        "1,x,100,5,a\n2,x,100,5,\n30,x,200,5,a\n40,x,100,5,b\n")
    kept = load(sessions, "burstgpt", window=(0.5, 1.5))
    assert [r.request_id for r in kept.requests] == ["bg-2", "bg-4"]
    assert _cut(sessions, "burstgpt", (0.5, 1.5), True) == \
        _cut(sessions, "burstgpt", (0.5, 1.5), False)
