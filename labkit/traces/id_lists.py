"""Reading and writing ``hash_ids`` lists without a Python object per id.

A trace is mostly its block ids: an AgentX-like call of 600K tokens lists ~10K of
them, so a 200-session trace is ~250 MB of digits and commas. Decoded by `json` into
lists of Python ints and turned into arrays by numpy, they cost ~3 s of a ~4.5 s
load. Here a compiled loop reads each list's digits straight into an int64 array;
`json` reads the rest of the text, each list replaced by its number (0, 1, ...); and
the arrays are put back where those numbers landed.

The shortcut is taken only where it gives exactly what `json` + numpy give. Every
``"hash_ids"`` key in the text must be outside any string (no backslash before its
quote) and hold a plain list — decimal integers of up to 18 digits without leading
zeros, separated by commas, spaces or tabs around them; and walking what `json` read
in document order must meet exactly those keys, holding 0, 1, ... in turn (a key
spelt with an escape, or given twice, would break the count). Anything else — a sign,
a fraction, an exponent, a string in the list, a trailing comma, a malformed text —
leaves the text to `json` whole, which accepts it or reports the error exactly as
before (`jsonl.read_objects`, the AgentX loader).

Writing (`ids_json`) is the same loop the other way: the list's text as `json.dumps`
spells it, digits written by a compiled loop (a 250 MB trace: ~3 s by `json`).
"""

from __future__ import annotations

import contextlib
import json
import threading

import numpy as np
from numba import njit

_KEY = b'"hash_ids"'
_SPACE = b" \t"


def split_ids(raw: bytes):
    """(the text with its hash_ids lists replaced by 0, 1, ..., the ids as int64
    arrays), or None where a list is not plain or there is none (see the module doc)."""
    parts, arrays, at = [], [], 0
    data = np.frombuffer(raw, dtype=np.uint8)
    while (key := raw.find(_KEY, at)) >= 0:
        if key and raw[key - 1] == 0x5C:  # '\': inside a string
            return None
        i = _skip(raw, key + len(_KEY))
        if raw[i : i + 1] != b":":
            return None
        i = _skip(raw, i + 1)
        if raw[i : i + 1] != b"[":
            return None
        out = _scratch(len(raw) // 2 + 1)  # (each id but the last takes a comma too)
        m, end = _scan_list(data, i, out)
        if end < 0:
            return None
        parts += (raw[at:i], str(len(arrays)).encode())
        arrays.append(out[:m].copy())
        at = end
    if not arrays:
        return None
    parts.append(raw[at:])
    return b"".join(parts), arrays


_json_only: list = []  # non-empty inside `json_only()`


@contextlib.contextmanager
def json_only():
    """Inside: no shortcut, every text read by `json` alone (what the shortcut is
    measured and checked against: `labkit bench traces`, the tests)."""
    _json_only.append(True)
    try:
        yield
    finally:
        _json_only.pop()


def loads_with_ids(raw: bytes, decode: str = "utf-8"):
    """`json.loads` of the text with each hash_ids list an int64 array, or None where
    the shortcut does not apply or the text is not JSON as read (the caller then reads
    it the ordinary way, errors and all)."""
    split = None if _json_only else split_ids(raw)
    if split is None:
        return None
    rest, arrays = split
    try:
        obj = json.loads(rest.decode(decode))
    except (ValueError, RecursionError):  # (UnicodeDecodeError and JSONDecodeError too)
        return None
    return obj if _put_back(obj, arrays) else None


def _put_back(obj, arrays: list) -> bool:
    """Walk `obj` in document order (json keeps a dict's keys in the text's order),
    putting arrays[k] where the k-th hash_ids key holds k; False if the keys met are
    not exactly those."""
    found, stack = 0, []
    _enter(stack, obj)
    while stack:
        node, items = stack[-1]
        item = next(items, None)
        if item is None:
            stack.pop()
        elif item[0] == "hash_ids" and isinstance(node, dict):
            if type(item[1]) is not int or item[1] != found:
                return False
            node["hash_ids"] = arrays[found]  # (a value replaced: the walk goes on)
            found += 1
        else:
            _enter(stack, item[1])
    return found == len(arrays)


def _enter(stack: list, value) -> None:
    if isinstance(value, dict):
        stack.append((value, iter(value.items())))
    elif isinstance(value, list):
        stack.append((value, iter(enumerate(value))))


def ids_json(ids: np.ndarray) -> str:
    """``json.dumps(ids.tolist(), separators=(",", ":"))`` for ids >= 0."""
    if _json_only or (len(ids) and ids.min() < 0):
        return json.dumps(ids.tolist(), separators=(",", ":"))
    return _spelt(np.ascontiguousarray(ids, dtype=np.int64)).tobytes().decode("ascii")


_local = threading.local()


def _scratch(size: int) -> np.ndarray:
    """This thread's scan buffer, with room for `size` ids: reused line after line,
    the ids copied out of it (one pass over the digits, memory already touched)."""
    buf = getattr(_local, "ids", None)
    if buf is None or len(buf) < size:
        buf = _local.ids = np.empty(max(size, 1 << 16), dtype=np.int64)
    return buf


def _skip(raw: bytes, i: int) -> int:
    while raw[i : i + 1] and raw[i : i + 1] in _SPACE:
        i += 1
    return i


@njit(cache=True)
def _scan_list(buf, at: int, out) -> tuple[int, int]:
    """buf[at] is '[': (how many integers the list holds, written to `out`, which has
    room for them all; the index after its ']'), or (-1, -1) where the list is not
    plain (see the module doc)."""
    close = len(buf)
    m = 0
    i = _skip_spaces(buf, at + 1, close)
    if i < close and buf[i] == 93:  # ']'
        return m, i + 1
    while True:
        if i >= close or buf[i] < 48 or buf[i] > 57:  # not a digit
            return -1, -1
        if buf[i] == 48 and i + 1 < close and 48 <= buf[i + 1] <= 57:
            return -1, -1  # a leading zero: not JSON
        value, start = 0, i
        while i < close and 48 <= buf[i] <= 57:
            value = value * 10 + (buf[i] - 48)
            i += 1
        if i - start > 18:
            return -1, -1  # maybe past int64 (numpy would not make it int64)
        out[m] = value
        m += 1
        i = _skip_spaces(buf, i, close)
        if i < close and buf[i] == 93:
            return m, i + 1
        if i >= close or buf[i] != 44:  # ','
            return -1, -1
        i = _skip_spaces(buf, i + 1, close)


@njit(cache=True)
def _skip_spaces(buf, i: int, stop: int) -> int:
    while i < stop and (buf[i] == 32 or buf[i] == 9):
        i += 1
    return i


_POWERS = 10 ** np.arange(19, dtype=np.int64)  # 1, 10, ..., 10**18


@njit(cache=True)
def _spelt(ids):
    """The ASCII bytes of "[id,id,...]" (ids >= 0, in decimal)."""
    digits = np.empty(len(ids), dtype=np.int64)
    size = 1 + max(len(ids), 1)  # the brackets and the commas between
    for k in range(len(ids)):
        d = 1
        while d < 19 and ids[k] >= _POWERS[d]:
            d += 1
        digits[k] = d
        size += d
    out = np.empty(size, dtype=np.uint8)
    out[0] = 91  # '['
    end = 1
    for k in range(len(ids)):
        if k:
            out[end] = 44  # ','
            end += 1
        x = np.uint64(ids[k])  # (unsigned: a division by 10 without sign fix-ups)
        for j in range(end + digits[k] - 1, end - 1, -1):
            q = x // np.uint64(10)
            out[j] = np.uint8(48 + (x - q * np.uint64(10)))
            x = q
        end += digits[k]
    out[end] = 93  # ']'
    return out
