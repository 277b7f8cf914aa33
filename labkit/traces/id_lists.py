"""Reading and writing ``hash_ids`` lists without a Python object per id.

A trace is mostly its block ids: an AgentX-like call of 600K tokens lists ~10K of
them, so a 200-session trace is ~250 MB of digits and commas. Decoded by `json` into
lists of Python ints and turned into arrays by numpy, they cost ~3 s of a ~4.5 s
load. Here a compiled loop reads each list's digits straight into an int64 array;
`json` reads the rest of the text, each list replaced by a one-number list of its
own (a 16-digit mark the text around the lists does not hold, then the list's
index); and each array is put back where its stand-in landed.

The shortcut is taken only where it gives exactly what `json` + numpy give. Every
``"hash_ids"`` key in the text must hold a plain list — decimal integers of up to 18
digits without leading zeros, separated by commas, JSON's whitespace around them — and
each list's stand-in must land as the value of a key that reads "hash_ids" (not one
that merely ends so; a key given twice keeps its last value, as json does). Anything
else — a sign, a fraction, an exponent, a string in the list, a trailing comma, a
malformed text, the mark in the text — leaves the text to `json` whole, which accepts
it or reports the error exactly as before (`jsonl.read_objects`, the AgentX loader).

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
_SPACE = b" \t\n\r"  # JSON's whitespace


# list k's stand-in: [the mark then k in 8 digits] — a list, as the one it replaces (so
# whatever surrounds it reads as before), of a number no text without the mark holds (a
# JSON int is spelt by its digits, and in no other way)
_MARK = b"8142957360518273"
_FIRST = int(_MARK) * 10**8


def split_ids(raw: bytes):
    """(the text with its hash_ids lists replaced by their stand-ins, the ids as int64
    arrays), or None where a list is not plain or there is none (see the module doc)."""
    parts, arrays, at = [], [], 0
    data = np.frombuffer(raw, dtype=np.uint8)
    while (key := raw.find(_KEY, at)) >= 0:
        colon = _skip(raw, key + len(_KEY))
        i = _skip(raw, colon + 1)
        if raw[colon : colon + 1] != b":" or raw[i : i + 1] != b"[" or len(arrays) == 10**8:
            return None
        close = raw.find(b"]", i)  # (a plain list ends at the first ']')
        if close < 0:
            return None
        out = _scratch((close - i) // 2 + 1)  # (each id but the last takes a comma too)
        m, end = _scan_list(data, i, out)
        if end < 0:
            return None
        if raw.find(_MARK, at, i) >= 0:  # (the text around the lists must not hold it)
            return None
        parts += (raw[at:i], b"[", _MARK, b"%08d]" % len(arrays))
        arrays.append(out[:m].copy())
        at = end
    if not arrays or raw.find(_MARK, at) >= 0:
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


def loads(text: str):
    """`json.loads(text)`, its hash_ids lists read as arrays where they can be."""
    obj = loads_with_ids(text.encode("utf-8"))
    return obj if obj is not None else json.loads(text)


def _put_back(obj, arrays: list) -> bool:
    """Put arrays[k] where list k's stand-in landed; False where one landed as the
    value of a key that is not "hash_ids". (A stand-in may be gone: its key given
    again later, whose value json keeps — as it drops the list.)"""
    stack = [obj] if isinstance(obj, (dict, list)) else []
    while stack:
        node = stack.pop()
        for key, value in (node.items() if isinstance(node, dict) else enumerate(node)):
            if isinstance(value, dict):
                stack.append(value)
            elif isinstance(value, list):
                k = _stand_in(value, len(arrays))
                if k < 0:
                    stack.append(value)
                elif key != "hash_ids":  # (list items have int keys)
                    return False
                else:
                    node[key] = arrays[k]  # (a value replaced: allowed while iterating)
    return True


def _stand_in(value: list, count: int) -> int:
    """k if `value` is list k's stand-in, [its number], else -1."""
    if len(value) == 1 and type(value[0]) is int and 0 <= (k := value[0] - _FIRST) < count:
        return k
    return -1


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
    while i < stop and (buf[i] == 32 or buf[i] == 9 or buf[i] == 10 or buf[i] == 13):
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
