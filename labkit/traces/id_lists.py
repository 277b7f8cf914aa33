"""Reading and writing a line's ``hash_ids`` list without a Python object per id.

A trace line is mostly its block ids: an AgentX-like call of 600K tokens lists ~10K
of them, so a 200-session trace is ~250 MB of digits and commas. Decoded by `json`
into a list of Python ints and turned into an array by numpy, they cost ~3 s of a
~4.5 s load (two thirds of it for ~14K lines). Here a compiled loop reads the list's
digits straight into an int64 array, the rest of the line goes to `json` with the
list replaced by ``null``, and the array is put back in its place.

The shortcut is taken only where it gives exactly what `json` + numpy give: one
``"hash_ids"`` key on the line, outside any string (no backslash before its quote),
the object's own key (not a nested object's: checked after `json` read the rest), and
a plain list — decimal integers of up to 18 digits without leading zeros, separated by
commas, spaces or tabs around them. Anything else — a sign, a fraction, an exponent,
a string, a trailing comma, a malformed line — leaves the line to `json` whole, which
accepts it or reports the error exactly as before (`jsonl.read_objects`).

Writing (`ids_json`) is the same loop the other way: the list's text as `json.dumps`
spells it, digits written by a compiled loop (a 250 MB trace: ~3 s by `json`).
"""

from __future__ import annotations

import json
import threading

import numpy as np
from numba import njit

_KEY = b'"hash_ids"'
_SPACE = b" \t"


def split_ids(raw: bytes):
    """(the line with its top-level hash_ids list replaced by ``null``, the ids as an
    int64 array), or None where the shortcut does not apply (see the module doc)."""
    at = raw.find(_KEY)
    if at < 0 or raw.find(_KEY, at + 1) >= 0 or (at and raw[at - 1] == 0x5C):  # '\'
        return None
    i = _skip(raw, at + len(_KEY))
    if raw[i : i + 1] != b":":
        return None
    i = _skip(raw, i + 1)
    if raw[i : i + 1] != b"[":
        return None
    out = _scratch(len(raw) // 2 + 1)  # (each id but the last takes a comma too)
    m, end = _scan_list(np.frombuffer(raw, dtype=np.uint8), i, out)
    if end < 0:
        return None
    return raw[:i] + b"null" + raw[end:], out[:m].copy()


def loads_with_ids(raw: bytes, decode: str):
    """The line's JSON object with its hash_ids an int64 array, or None where the
    shortcut does not apply or the rest of the line is not a JSON object as read
    (the caller then reads the whole line the ordinary way, errors and all)."""
    split = split_ids(raw)
    if split is None:
        return None
    rest, ids = split
    try:
        obj = json.loads(rest.decode(decode))
    except (ValueError, RecursionError):  # (UnicodeDecodeError and JSONDecodeError too)
        return None
    if not isinstance(obj, dict) or "hash_ids" not in obj or obj["hash_ids"] is not None:
        return None  # the key was a nested object's
    obj["hash_ids"] = ids
    return obj


def ids_json(ids: np.ndarray) -> str:
    """``json.dumps(ids.tolist(), separators=(",", ":"))`` for ids >= 0."""
    if len(ids) and ids.min() < 0:
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
