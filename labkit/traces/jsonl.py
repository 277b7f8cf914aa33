"""Reading JSON-lines trace files with errors that point at the line.

Both trace formats we read (labkit's own and Mooncake's) are JSON lines: one JSON
object per line. This module does the format-independent part: parse each line,
check that the object has exactly the expected fields with the expected JSON
types, and turn the ``hash_ids`` list into an int64 array -- raising
``TraceError("<path>:<line>: <reason>")`` at the first problem. Blank lines are
skipped (but still counted, so line numbers match what an editor shows).
"""
from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator

import numpy as np

from labkit.traces.id_lists import loads_with_ids
from labkit.traces.validate import TraceError

# JSON type names used in field specs, and how to recognise them. bool is a
# subclass of int in Python, but `true` is not a valid length.
_TYPE_CHECKS = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    # elements checked by id_array (an array: read by `id_lists.py`, int64 already)
    "list of integers": lambda v: isinstance(v, (list, np.ndarray)),
}

# A field spec maps a field name to (JSON type, required, nullable).
FieldSpec = dict[str, tuple[str, bool, bool]]


def open_text(path: str):
    """Open a trace for reading; ``.gz`` files are decompressed on the fly."""
    if str(path).endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def read_lines(path: str) -> Iterator[tuple[int, str]]:
    """Yield ``(line_number, text)`` for every line (1-based), decoded as UTF-8.

    Whatever is wrong with the bytes becomes a TraceError naming the file (and the
    line, where the damage is on one): text in another encoding (UTF-16, Latin-1),
    binary data, a gzip file that is truncated, corrupt, or not gzip at all. A UTF-8
    byte-order mark is allowed."""
    for line_no, raw in _raw_lines(path):
        yield line_no, _decoded(raw, line_no, path)


def first_line(path: str) -> tuple[int, str | None]:
    """(its number, the first line that is not blank, stripped), or (1, None) when
    every line is (bytes that are not UTF-8 text are a TraceError, as `read_lines`)."""
    lines = read_lines(path)
    try:
        for line_no, text in lines:
            if text.strip():
                return line_no, text.strip()
    finally:
        lines.close()  # (the file too)
    return 1, None


def _raw_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """``(line_number, bytes)`` for every line (a damaged gzip file or UTF-16 text is a
    TraceError, see `read_lines`)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    line_no = 0
    with opener(path, "rb") as f:
        try:
            for line_no, raw in enumerate(f, start=1):
                if line_no == 1 and raw[:2] in (b"\xff\xfe", b"\xfe\xff"):
                    raise TraceError(path, 1, "the file is UTF-16 text; traces are UTF-8 "
                                              "(convert it, e.g. iconv -f UTF-16 -t UTF-8)")
                yield line_no, raw
        except (OSError, EOFError, zlib.error) as e:  # gzip: truncated, corrupt, not gzip
            raise TraceError(path, line_no + 1, f"damaged gzip file ({e})") from None


def _encoding(line_no: int) -> str:
    return "utf-8-sig" if line_no == 1 else "utf-8"  # (a byte-order mark may open line 1)


def _decoded(raw: bytes, line_no: int, path: str) -> str:
    try:
        return raw.decode(_encoding(line_no))
    except UnicodeDecodeError as e:
        raise TraceError(path, line_no, f"not UTF-8 text (byte {raw[e.start]:#04x} "
                                        f"at column {e.start + 1}); binary data, or "
                                        "another encoding such as Latin-1") from None


def read_objects(path: str) -> Iterator[tuple[int, dict]]:
    """Yield ``(line_number, object)`` for each non-blank line (1-based). A
    ``hash_ids`` list of plain integers comes as an int64 array (read without a
    Python int per id, `id_lists.py`); any other list as `json` reads it."""
    for line_no, raw in _raw_lines(path):
        obj = loads_with_ids(raw, _encoding(line_no))
        if isinstance(obj, dict):  # (anything else: read again below, which says why)
            yield line_no, obj
            continue
        text = _decoded(raw, line_no, path)
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise TraceError(path, line_no,
                             f"invalid JSON: {e.msg} (column {e.colno})") from None
        except RecursionError:
            raise TraceError(path, line_no, "JSON nested too deeply") from None
        if not isinstance(obj, dict):
            raise TraceError(path, line_no,
                             f"expected a JSON object, got {type(obj).__name__}")
        yield line_no, obj


def check_fields(obj: dict, spec: FieldSpec, path: str, line: int) -> None:
    """Raise TraceError if a required field is missing, a field is unknown, or a
    value has the wrong JSON type (checked in that order, fields in spec order)."""
    for name, (_, required, _) in spec.items():
        if required and name not in obj:
            raise TraceError(path, line, f"missing field {name!r}")
    for name in obj:
        if name not in spec:
            raise TraceError(path, line, f"unknown field {name!r}")
    for name, (type_name, _, nullable) in spec.items():
        if name not in obj:
            continue
        value = obj[name]
        if value is None and nullable:
            continue
        if not _TYPE_CHECKS[type_name](value):
            article = "an" if type_name[0] in "aeiou" else "a"
            expected = f"{article} {type_name}" + (" or null" if nullable else "")
            raise TraceError(path, line, f"field {name!r} must be {expected}, "
                                         f"got {_json_type(value)}")


def id_array(values: list, path: str, line: int) -> np.ndarray:
    """The ``hash_ids`` list as an int64 array (range is checked by check_request)."""
    if isinstance(values, np.ndarray):  # (`read_objects` read it as one)
        return values
    if not values:
        return np.empty(0, dtype=np.int64)
    try:
        arr = np.array(values)
    except (ValueError, OverflowError):
        arr = None
    # Any non-integer element (float, string, null, bool, nested list) makes numpy
    # pick a non-integer dtype, so one dtype test covers them all without a
    # Python loop over millions of ids.
    if arr is None or arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise TraceError(path, line, "field 'hash_ids' must be a list of integers")
    if arr.dtype.kind == "u" and arr.max() > np.iinfo(np.int64).max:
        raise TraceError(path, line, "hash_ids must be integers in [0, 2**40)")
    return arr.astype(np.int64, copy=False)


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {str: "string", int: "integer", float: "number", list: "list",
            dict: "object"}.get(type(value), type(value).__name__)
