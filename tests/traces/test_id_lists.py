"""A line's hash_ids read without Python ints (`id_lists.py`) give exactly what `json`
and numpy give: the same objects for every line json reads, the same TraceError for
every line it refuses, a fallback wherever the list is not plain — checked against
`read_objects` with the shortcut turned off, on lines written every way JSON allows
and on lines that break it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from labkit.traces import TraceError, generate_agentx_trace, load_trace, write_trace
from labkit.traces import jsonl
from labkit.traces.id_lists import _scan_list, json_only, loads_with_ids, split_ids


def reference_objects(path):
    """`read_objects` the way it was before the shortcut: json for every line."""
    with json_only():
        return _objects(path)


def _objects(path):
    """The lines' objects, every hash_ids value (at any depth) as ("ids", dtype, ids)
    where it is (or json's list would make) an integer array; or the error's text."""
    try:
        return [(line, _norm(obj)) for line, obj in jsonl.read_objects(str(path))]
    except TraceError as e:
        return str(e)


def _norm(value, key=None):
    if isinstance(value, dict):
        return {k: _norm(v, k) for k, v in value.items()}
    if key == "hash_ids" and isinstance(value, (list, np.ndarray)):
        try:
            arr = np.array(value) if isinstance(value, list) else value
        except (ValueError, OverflowError):
            arr = None
        if arr is not None and arr.ndim == 1 and (arr.dtype.kind in "iu" or len(arr) == 0):
            return ("ids", str(arr.astype(np.int64).dtype) if isinstance(value, list)
                    else str(arr.dtype), arr.tolist())
    if isinstance(value, list):
        return [_norm(v) for v in value]
    assert not isinstance(value, np.ndarray), "an array where json has no hash_ids list"
    return value


# how a hash_ids list may be spelt, and how it may be broken (the line around it is
# well-formed unless the case says otherwise)
LISTS = [
    "[1,2,3]", "[ 1 , 2 ,3 ]", "[\t7,\t8\t]", "[]", "[ ]", "[0]", "[0,0,10]",
    "[123456789012345678]",            # 18 digits: taken
    "[\n1,\r\n2\n]",                     # a list over lines (pretty-printed JSON)
    "[1234567890123456789]",           # 19 digits, in int64: json's way
    "[99999999999999999999]",          # past int64: json's way, then an error
    "[01]", "[-1]", "[-0]", "[1.0]", "[1e3]", "[1,]", "[,1]", "[1,,2]", "[1 2]",
    '["1"]', "[null]", "[true]", "[[1]]", "[1, [2]]", "[1", "1]", "[1,2]]", "[1,2],",
]


def line_with(ids_text: str, **extra) -> str:
    head = json.dumps({"block_size": 16, "session_id": "s", "request_id": "r",
                       "parent_id": None, "kind": "main", "delay_s": 0.0,
                       "input_length": 20, "output_length": 3, **extra})
    return head[:-1] + f', "hash_ids": {ids_text}}}'


@pytest.mark.parametrize("ids_text", LISTS)
def test_each_spelling_of_the_list_reads_as_json_reads_it(tmp_path, ids_text):
    path = tmp_path / "t.jsonl"
    path.write_text(line_with("[5, 6]") + "\n" + line_with(ids_text) + "\n")
    assert _objects(path) == reference_objects(path)


ODD_LINES = [
    # the key inside a string, escaped; twice on the line; a nested object's
    '{"a": "x\\"hash_ids\\": [1,2]", "hash_ids": [3]}',
    '{"hash_ids": [1], "hash_ids": [2, 3]}',
    '{"hash_ids": [1], "b": "hash_ids"}',
    '{"nested": {"hash_ids": [1, 2]}}',
    # ... where taking the wrong list would go unnoticed after json read the rest
    '{"abc\\"hash_ids": [1, 2], "hash\\u005fids": null}',
    '{"abc\\"hash_ids": [1, 2], "hash\\u005fids": 0}',
    '{"x": {"hash_ids": [1]}, "hash_ids": null}',
    '{"hash\\u005fids": [5], "x": {"hash_ids": [1, 2]}}',
    '{"hash\\u005fids": 0, "x": {"hash_ids": [5]}}',
    '{"x": {"hash_ids": [1]}, "hash\\u005fids": 0}',
    '{"x": {"hash_ids": [1]}, "hash_ids": 1}',
    '{"x": {"hash_ids": [1]}, "y": {"hash\\u005fids": 1}}',
    # several lists, nested in any order; one not plain among them
    '{"a": {"hash_ids": [1]}, "hash_ids": [2], "b": [{"hash_ids": [3, 4]}, {"hash_ids": []}]}',
    '{"a": {"hash_ids": [1]}, "hash_ids": [2], "b": [{"hash_ids": [3, 4.5]}]}',
    '{"hash_ids": [1], "a": {"hash_ids": [2]}, "hash_ids": [3]}',
    '{"hash_ids": [1], "hash\\u005fids": 0}',
    # the lists' stand-in numbers spelt in the text (found by the fuzzer below)
    '{"hash_ids": [5], "hash\\u005fids": 814295736051827300000000}',
    '{"hash_ids": [5], "v": 814295736051827300000000}',
    '{"hash_ids": [5], "v": [814295736051827300000000]}',
    '{"hash_ids": [814295736051827300000000], "v": 1}',
    '{"hash_ids": [5], "hash\\u005fids": [814295736051827300000000]}',
    '{"hash_ids": [5], "hash\\u005fids": [814295736051827300000000], "b": {"hash_ids": [7]}}',
    # a number, a fraction, an exponent right after the list: not JSON, before or after
    '{"hash_ids": [1]5}',
    '{"hash_ids": [1].5}',
    '{"hash_ids": [1]e5}',
    '{"hash_ids": [1] 5}',
    '[{"hash_ids": [1]}, {"hash_ids": [2]}]',
    '{"requests": [{"hash_ids": [1, 2]}]}',
    '{"hash_ids" : [4,5] , "x": 1}',
    '{"hash_ids":[4,5]}',
    # broken around a good list: bad JSON before or after it, not an object
    '{"a": , "hash_ids": [1, 2]}',
    '{"hash_ids": [1, 2], "a": }',
    '{"hash_ids": [1, 2]',
    '["hash_ids", [1, 2]]',
    '"hash_ids": [1, 2]',
    '{"hash_ids": [1, 2]} {"x": 1}',
    '',
    '   ',
]


@pytest.mark.parametrize("text", ODD_LINES)
def test_odd_lines_read_as_json_reads_them(tmp_path, text):
    path = tmp_path / "t.jsonl"
    path.write_text('{"hash_ids": [9]}\n' + text + "\n")
    assert _objects(path) == reference_objects(path)


def test_bytes_that_are_not_utf8_are_reported_as_before(tmp_path):
    for raw in (b'\xef\xbb\xbf{"hash_ids": [1, 2], "a": 1}',  # a byte-order mark: fine
                b'{"hash_ids": [1, 2], "a": "\xe9"}',  # Latin-1 after the list
                b'{"a": "\xe9", "hash_ids": [1, 2]}',  # ... and before it
                b'{"hash_ids": [1, \xe9]}'):
        path = tmp_path / "t.jsonl"
        path.write_bytes(raw + b"\n" + raw + b"\n")
        assert _objects(path) == reference_objects(path), raw


def test_random_plain_lists_are_scanned_exactly():
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(0, 40))
        digits = rng.integers(1, 19, n)
        values = [int(rng.integers(0, 10 ** int(d))) for d in digits]
        spaces = [" " * int(k) for k in rng.integers(0, 3, 2 * n + 1)]
        text = "[" + spaces[0] + ",".join(
            f"{spaces[2 * i + 1]}{v}{spaces[2 * i + 2]}" for i, v in enumerate(values)) + "]"
        raw = f'{{"a": 1, "hash_ids": {text}, "b": 2}}'.encode()
        obj = loads_with_ids(raw, "utf-8")
        assert obj is not None, text  # taken: a plain list
        assert obj["hash_ids"].dtype == np.int64
        assert obj["hash_ids"].tolist() == json.loads(raw)["hash_ids"]
        assert {k: v for k, v in obj.items() if k != "hash_ids"} == {"a": 1, "b": 2}


def test_the_scanner_stops_at_the_first_thing_json_would_not_call_plain():
    out = np.zeros(8, dtype=np.int64)
    assert _scan_list(np.frombuffer(b"[1, 2, x]", dtype=np.uint8), 0, out) == (-1, -1)
    assert _scan_list(np.frombuffer(b"xx[10,20] tail", dtype=np.uint8), 2, out) == (2, 9)
    assert out[:2].tolist() == [10, 20]


def test_a_written_trace_takes_the_shortcut_and_loads_as_before(tmp_path):
    trace = generate_agentx_trace(4, seed=3, context_window_tokens=40_000,
                                  compact_threshold_tokens=20_000)
    path = tmp_path / "t.jsonl"
    write_trace(trace, path)
    lines = path.read_bytes().splitlines()
    assert all(split_ids(raw) is not None for raw in lines)  # every line the quick way
    assert [raw.decode() for raw in lines] == [json.dumps({  # spelt as json spells it
        "block_size": trace.block_size, "session_id": r.session_id,
        "request_id": r.request_id, "parent_id": r.parent_id, "kind": r.kind,
        "delay_s": float(r.delay_s), "input_length": r.input_length,
        "output_length": r.output_length, "hash_ids": r.hash_ids.tolist(),
        "timestamp": r.timestamp, "priority": r.priority}, separators=(",", ":"))
        for r in trace.requests]
    fast = load_trace(path)
    with json_only():
        slow = load_trace(path)
    assert len(fast.requests) == len(slow.requests) == len(trace.requests)
    for a, b, c in zip(fast.requests, slow.requests, trace.requests):
        assert a.request_id == b.request_id == c.request_id
        assert np.array_equal(a.hash_ids, b.hash_ids) and np.array_equal(a.hash_ids, c.hash_ids)
        assert a.hash_ids.dtype == b.hash_ids.dtype == np.int64


def test_ids_are_written_as_json_writes_them():
    rng = np.random.default_rng(1)
    from labkit.traces.id_lists import ids_json
    cases = [np.zeros(0, np.int64), np.array([0]), np.array([9, 10, 11, 99, 100, 101]),
             10 ** np.arange(19, dtype=np.int64), 10 ** np.arange(1, 19, dtype=np.int64) - 1,
             np.array([np.iinfo(np.int64).max]), np.array([3, -4, 5])]
    cases += [rng.integers(0, 2**40, int(rng.integers(1, 50))) for _ in range(100)]
    for ids in cases:
        assert ids_json(ids) == json.dumps(ids.tolist(), separators=(",", ":"))


@pytest.mark.parametrize("name", ["agentx.json", "agentx_many.jsonl", "bailian.jsonl"])
def test_published_formats_load_as_before_and_take_the_shortcut(monkeypatch, name):
    """The JSON formats whose calls carry hash_ids — nested in AgentX trace objects, in
    a file of one object over many lines or of one per line — load exactly as with
    json alone, and their lists are read the quick way."""
    from pathlib import Path

    from labkit.traces import id_lists

    path = Path(__file__).parent / "fixtures" / name
    taken, shortcut = [], id_lists.loads_with_ids

    def counted(raw, decode="utf-8"):
        obj = shortcut(raw, decode)
        taken.append(obj is not None)
        return obj

    with monkeypatch.context() as m:
        m.setattr(jsonl, "loads_with_ids", counted)  # (lines: read_objects)
        m.setattr(id_lists, "loads_with_ids", counted)  # (whole texts: id_lists.loads)
        fast = load_trace(path)
    assert any(taken)
    with json_only():
        slow = load_trace(path)
    assert len(fast.requests) == len(slow.requests) > 0
    for a, b in zip(fast.requests, slow.requests):
        assert (a.session_id, a.request_id, a.parent_id, a.kind, a.delay_s, a.input_length,
                a.output_length, a.timestamp) == (b.session_id, b.request_id, b.parent_id,
                                                  b.kind, b.delay_s, b.input_length,
                                                  b.output_length, b.timestamp)
        assert a.hash_ids.dtype == b.hash_ids.dtype and np.array_equal(a.hash_ids, b.hash_ids)


def _random_text(rng) -> str:
    """A JSON text (sometimes not JSON) with hash_ids keys — plain, escaped, inside
    strings — at any depth, holding lists spelt every way and other values."""
    keys = ['"hash_ids"', '"hash\\u005fids"', '"a"', '"b\\"hash_ids"', '"x"', '"hash_ids "']
    odd = ["-1", "01", "1.5", "1e3", "99999999999999999999", "-0", "1234567890123456789"]

    def number():
        return (str(int(rng.integers(0, 10 ** int(rng.integers(1, 19)))))
                if rng.random() < 0.95 else str(rng.choice(odd)))

    def space():
        return str(rng.choice(["", " ", "  ", "\t", "\n ", "\r\n"]))

    def listed(depth):
        items = [number() if rng.random() < 0.9 else value(depth + 1)
                 for _ in range(int(rng.integers(0, 5)))]
        w = space()
        body = (w + ("," if rng.random() < 0.97 else ",,") + w).join(items)
        junk = str(rng.choice(["5", ".5", "e5", " 5"])) if rng.random() < 0.02 else ""
        return "[" + w + body + ("," if rng.random() < 0.02 else "") + w + "]" + junk

    def value(depth):
        r = rng.random()
        if depth > 3 or r < 0.3:
            return str(rng.choice(["null", "1", "0", '"s"', '"hash_ids"', "true", "2.5",
                                   "[814295736051827300000000]", "814295736051827300000001"]))
        return listed(depth) if r < 0.6 else obj(depth + 1)

    def obj(depth):
        parts = []
        for _ in range(int(rng.integers(0, 5))):
            key = str(rng.choice(keys, p=[0.5, 0.05, 0.15, 0.05, 0.2, 0.05]))
            v = listed(depth) if key == '"hash_ids"' and rng.random() < 0.8 else value(depth)
            w = space()
            parts.append(f"{key}{w}:{w}{v}")
        return "{" + ",".join(parts) + "}"

    return obj(0) if rng.random() < 0.9 else f"[{obj(0)},{obj(0)}]"


def _as_ids(x, key=None):
    """Every hash_ids value json would give as a list of int64-sized ints (or the
    shortcut as an array) made ("ids", [...]), at any depth."""
    if isinstance(x, dict):
        return {k: _as_ids(v, k) for k, v in x.items()}
    if isinstance(x, np.ndarray):
        assert key == "hash_ids" and x.dtype == np.int64
        return ("ids", x.tolist())
    if isinstance(x, list):
        if key == "hash_ids" and all(type(v) is int and 0 <= v < 2**63 for v in x):
            return ("ids", x)
        return [_as_ids(v) for v in x]
    return x


def test_random_texts_read_as_json_reads_them():
    """Where the shortcut answers, it answers what json does (a fixed-seed fuzz; it
    found an escaped duplicate key's value taken for a list's stand-in, and a stand-in
    number run on by the digits after a damaged list)."""
    rng = np.random.default_rng(31)
    taken = 0
    for _ in range(4000):
        text = _random_text(rng)
        got = loads_with_ids(text.encode())
        if got is None:
            continue
        taken += 1
        assert _as_ids(got) == _as_ids(json.loads(text)), text
    assert taken > 300  # (the shortcut is taken often enough to be tested)
