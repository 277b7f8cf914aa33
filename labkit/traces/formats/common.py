"""What the published trace formats have in common once they are read.

Every format ends as the canonical trace (``schema.py``): requests whose prompts are
lists of block ids. Three steps recur across formats and live here:

* **CSV rows with line numbers.** Azure, BurstGPT and Splitwise publish CSV files
  with a header. ``csv_rows`` yields each data row as a dict with its file line, so a
  bad value is reported as ``"<path>:<line>: column 'X': ..."`` like a bad JSON line.
* **Fresh ids for formats without hashes.** A CSV row gives only token counts: we
  know nothing about what two prompts share, so each prompt gets block ids no other
  prompt has (no prefix reuse is invented). ``FreshIds`` mints them.
* **Opaque hashes made small.** Bailian's and AgentX's ids are hashes; ids at or above
  2**40 (or negative) are renumbered densely, keeping equal ids equal, so that
  engines can pack them with other keys. ``Trace`` then makes them chain-unique, as
  for Mooncake (see ``canonical.py``).

A row whose output length is 0 (a failed request in BurstGPT, a 0 in an Azure
file) is loaded as a request generating **one** token: the server still received
and prefilled it, and an engine cannot schedule a request that generates nothing.
"""
from __future__ import annotations

import csv
import zlib
from collections.abc import Iterator

import numpy as np

from labkit.traces.formats.row_filter import RowFilter
from labkit.traces.jsonl import open_text, read_lines
from labkit.traces.schema import Trace, TraceRequest
from labkit.traces.streams import IdMinter
from labkit.traces.validate import (
    MAX_HASH_ID, MAX_OUTPUT_TOKENS, MAX_PROMPT_TOKENS, TraceError, check_request)

# Block size given to traces whose format has no block ids: any engine block size
# that divides it or is a multiple of it works (16, 32, 64, 128, ...).
TOKENS_ONLY_BLOCK_SIZE = 64


def csv_rows(path: str, required: tuple[str, ...], format_name: str,
             where: RowFilter | None = None) -> Iterator[tuple[int, dict[str, str]]]:
    """Yield ``(line, row)`` for each non-blank data row of a CSV file with a header
    (``where``: each one it accepts, `row_filter.py`).

    Raises TraceError on line 1 when a required column is missing, on a row with
    more or fewer cells than the header, and on the line where the file is damaged (a
    corrupt or truncated gzip file, bytes that are not UTF-8, a cell past the csv
    module's size limit).
    """
    with open_text(path) as f:
        reader = csv.reader(f)
        try:
            rows = _rows(reader, required, format_name, path, where)
            yield from rows if where is None else where.kept(rows, path)
        except csv.Error as e:  # (the line being parsed)
            raise TraceError(path, max(reader.line_num, 1), f"unreadable CSV ({e})") from None
        except UnicodeDecodeError:  # (text is decoded a buffer at a time: find the line)
            for _ in read_lines(path):
                pass
            raise
        except (OSError, EOFError, zlib.error) as e:  # gzip: truncated, corrupt, not gzip
            raise TraceError(path, reader.line_num + 1, f"damaged gzip file ({e})") from None


def _rows(reader, required: tuple[str, ...], format_name: str, path: str, where):
    """`csv_rows` of an open reader, every row."""
    header = next(reader, None)
    if header is None:
        raise TraceError(path, 1, "empty trace: no header line")
    columns = [c.strip() for c in header]
    missing = [c for c in required if c not in columns]
    if missing:
        raise TraceError(path, 1, f"{format_name} CSV needs column(s) "
                                  f"{', '.join(map(repr, missing))}; the header has "
                                  f"{', '.join(map(repr, columns))}")
    if where is not None:
        where.missing(columns, path)
    for cells in reader:
        line = reader.line_num
        if not any(c.strip() for c in cells):
            continue
        if len(cells) != len(columns):
            raise TraceError(path, line, f"{len(cells)} cells, but the header has "
                                         f"{len(columns)} columns")
        yield line, dict(zip(columns, (c.strip() for c in cells), strict=True))


def float_cell(row: dict[str, str], column: str, path: str, line: int,
               whole: bool = False) -> float:
    """A finite number (``whole``: an integral one) from a CSV cell, or TraceError."""
    text = row[column]
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not np.isfinite(value) or (whole and value != int(value)):
        kind = "whole" if whole else "finite"
        raise TraceError(path, line, f"column {column!r}: {text!r} is not a {kind} number")
    return value


def int_cell(row: dict[str, str], column: str, path: str, line: int) -> int:
    """A whole number (``"12"`` or ``"12.0"``) from a CSV cell, or TraceError."""
    return int(float_cell(row, column, path, line, whole=True))


def output_tokens(n):
    """Output length as replayed: 0 becomes 1 (see the module docstring); elementwise
    on an array."""
    return np.maximum(n, 1) if isinstance(n, np.ndarray) else max(n, 1)


def fresh_blocks(input_length: int, block_size: int) -> int:
    """How many fresh ids a prompt gets: none where it is refused (`check_request`
    says why, in file order), rather than gigabytes of ids minted for a damaged count."""
    if not 0 < input_length <= MAX_PROMPT_TOKENS:
        return 0
    return -(-input_length // block_size)


class FreshIds:
    """Requests of unknown content for the token-count formats: every block of every
    prompt gets an id no other block has."""

    def __init__(self, block_size: int = TOKENS_ONLY_BLOCK_SIZE) -> None:
        self.block_size = block_size
        self._minter = IdMinter()

    def request(self, where: tuple[str, int], request_id: str, input_length: int,
                output_length: int, timestamp: float | None, session_id: str | None = None,
                parent_id: str | None = None, delay_s: float = 0.0) -> TraceRequest:
        """A main call (its own session unless ``session_id``), checked on its own:
        TraceError at ``where`` = (path, line) when malformed."""
        req = TraceRequest(
            session_id=session_id or request_id, request_id=request_id, parent_id=parent_id,
            kind="main", delay_s=delay_s, input_length=input_length,
            output_length=output_tokens(output_length),
            hash_ids=self._minter.take(fresh_blocks(input_length, self.block_size)),
            timestamp=timestamp)
        reason = check_request(req, self.block_size)
        if reason:
            raise TraceError(*where, reason)
        return req

    def many(self, names: list[str], inputs: np.ndarray, outputs: np.ndarray,
             timestamps: np.ndarray, sessions: list[str | None] | None = None,
             parents: list[str | None] | None = None, delays: np.ndarray | None = None,
             keep: np.ndarray | None = None) -> list[TraceRequest] | None:
        """``request`` for many rows at once (``csv_columns``): the same requests, ids
        minted in the same order -- or None, minting nothing, where one of them would
        be refused (the row reader then names it). ``keep``: the rows to make requests
        of (every row is still checked, and counted in the ids: a kept row's ids are
        those it gets when all are made)."""
        if len(inputs) == 0 or (inputs <= 0).any() or (inputs > MAX_PROMPT_TOKENS).any() or \
                (outputs > MAX_OUTPUT_TOKENS).any() or (timestamps < 0).any() or \
                (delays is not None and (delays < 0).any()):
            return None
        blocks = -(-inputs // self.block_size)
        ends = np.cumsum(blocks)
        if keep is None:  # one array, a view of it per request
            ids = self._minter.take(int(ends[-1]))
            hash_ids = [ids[a:b] for a, b in zip([0, *ends[:-1].tolist()], ends.tolist())]
            n = len(names)
            sessions, parents = sessions or [None] * n, parents or [None] * n
            delays_s = delays.tolist() if delays is not None else [0.0] * n
        else:  # the kept rows' ids only, every row counted
            rows = np.flatnonzero(keep)
            hash_ids = self._kept_ids(blocks, ends, rows)
            names = [names[i] for i in rows]
            sessions = [sessions[i] for i in rows] if sessions else [None] * len(rows)
            parents = [parents[i] for i in rows] if parents else [None] * len(rows)
            delays_s = delays[rows].tolist() if delays is not None else [0.0] * len(rows)
            inputs, outputs, timestamps = inputs[rows], outputs[rows], timestamps[rows]
        # positional: TraceRequest(session_id, request_id, parent_id, kind, delay_s,
        # input_length, output_length, hash_ids, timestamp)
        return [TraceRequest(session or name, name, parent, "main", delay, inp, out, h, t)
                for name, inp, out, h, t, session, parent, delay in zip(
                    names, inputs.tolist(), output_tokens(outputs).tolist(), hash_ids,
                    timestamps.tolist(),
                    sessions, parents, delays_s, strict=True)]

    def _kept_ids(self, blocks: np.ndarray, ends: np.ndarray, rows: np.ndarray) -> list:
        """Each kept row's ids as minting all rows in order gives them (the minter
        moves past all of them)."""
        first = self._minter.next_id
        self._minter.next_id += int(ends[-1])
        counts = blocks[rows]
        cuts = np.cumsum(counts)
        flat = np.arange(int(cuts[-1]) if len(rows) else 0, dtype=np.int64) \
            + np.repeat(first + ends[rows] - counts - (cuts - counts), counts)
        return [flat[a:b] for a, b in zip([0, *cuts[:-1].tolist()], cuts.tolist())]

    def trace(self, requests: list[TraceRequest], path: str, format_name: str) -> Trace:
        if not requests:
            raise TraceError(path, 2, "empty trace: no requests")
        return Trace(self.block_size, requests, source=path, format=format_name)


def compact_ids(hash_lists: list[np.ndarray], offset: int = 0) -> tuple[list[np.ndarray], int]:
    """``hash_lists`` renumbered to ``offset, offset + 1, ...`` (equal ids stay equal),
    and the next free id. Used for hashes too large (or negative) to keep."""
    if not hash_lists:
        return [], offset
    flat = np.concatenate(hash_lists)
    if len(flat) == 0:
        return hash_lists, offset
    low, high = int(flat.min()), int(flat.max())
    if low >= 0 and high < 4 * len(flat) + 2**20:  # ids that can index a table
        # an id's rank among the distinct ids, as np.unique's inverse gives it
        present = np.zeros(high + 1, dtype=np.bool_)
        present[flat] = True
        rank = np.cumsum(present, dtype=np.int64) - 1
        dense, count = rank[flat], int(rank[-1]) + 1
    else:
        distinct, dense = np.unique(flat, return_inverse=True)
        dense, count = dense.astype(np.int64), len(distinct)
    dense += offset
    cuts = np.cumsum([len(h) for h in hash_lists])[:-1]
    return list(np.split(dense, cuts)), offset + count


def needs_compacting(hash_lists: list[np.ndarray]) -> bool:
    return any(len(h) and (h.min() < 0 or h.max() >= MAX_HASH_ID) for h in hash_lists)
