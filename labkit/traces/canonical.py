"""Chain-unique block ids: when an id alone can serve as a prefix-cache key.

A prefix cache keys a block by its content *and everything before it* (vLLM
chains the parent block's hash into each block's hash). Trace files only promise
"equal ids = equal block content", so in general the key of block ``j`` would be
the whole tuple ``(id_0, ..., id_j)``.

We avoid carrying tuples around by making ids **chain-unique** at load: an id
never appears at two different block positions, nor after two different
predecessor ids. Then, by induction, an id determines its whole prefix, and an
engine may use the id by itself as the cache key.

Most traces already are chain-unique (Mooncake's and our generator's are), so we
first *check* cheaply and only re-number when needed. Re-numbering gives one new
id per distinct chain ``(canonical predecessor, raw id)``, built level by level
(block position 0, 1, 2, ...), since a block's canonical id depends on its
predecessor's. The first chain to use a raw id keeps it, so ids stay recognisable;
the others get fresh ids above the largest raw id (or, when that would pass 2**40,
every chain is numbered 0, 1, 2, ... in order of first appearance).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from labkit.traces.validate import MAX_HASH_ID


def _dense(ids: np.ndarray) -> tuple[np.ndarray, int]:
    """Ids renamed to small non-negative integers (kept as they are when already
    small), and a bound on them -- so that tables can be indexed by id."""
    top = int(ids.max())
    if top < 4 * len(ids) + 2**20:
        return ids, top + 1
    _, dense = np.unique(ids, return_inverse=True)
    return dense.astype(np.int64, copy=False), int(dense.max()) + 1


def _flatten(hash_lists: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, int]:
    """All ids in one array (densified), the prompt lengths, and the id bound."""
    lengths = _lengths(hash_lists)
    ids = np.concatenate(hash_lists) if hash_lists else np.empty(0, np.int64)
    if len(ids) == 0:
        return ids, lengths, 0
    dense, n_ids = _dense(ids)
    return dense, lengths, n_ids


CHECK_CHUNK = 1 << 22  # ids joined at a time while checking (32 MB)


def is_chain_unique(hash_lists: list[np.ndarray], top: int | None = None) -> bool:
    """Does every id have a single block position and a single predecessor?

    Two tables indexed by id hold the position and the predecessor an id was first
    seen with; every later entry must agree: O(n), no sort. The lists are read a part
    at a time (`_parts`), never joined all at once: a generated 400-session trace holds
    some 600 MB of ids, and joining them (with a column or two besides) quadrupled what
    generating it needed. Ids far above their count are first renamed densely.
    ``top``: the largest id, where the caller knows it (``largest_id``).
    """
    lengths = _lengths(hash_lists)
    total = int(lengths.sum())
    if total == 0:
        return True
    top = largest_id(hash_lists) if top is None else top
    if top >= 4 * total + 2**20:  # sparse ids: tables by id would be too large
        dense, lengths, n_ids = _flatten(hash_lists)
        return _agree(dense, lengths, np.full(n_ids, -1, dtype=np.int32),
                      np.empty(n_ids, dtype=np.int64))
    position = np.full(top + 1, -1, dtype=np.int32)
    before = np.empty(top + 1, dtype=np.int64)
    return all(_agree(ids, part_lengths, position, before)
               for ids, part_lengths in _parts(hash_lists, lengths))


def largest_id(hash_lists: list[np.ndarray]) -> int:
    """The largest id of all the lists (-1 when there is none)."""
    return id_range(hash_lists)[1]


def id_range(hash_lists: list[np.ndarray]) -> tuple[int, int]:
    """The smallest and the largest id of all the 1-D lists ((0, -1) when there is
    none): one compiled pass over each part (`_parts`)."""
    low, high = 0, -1
    for ids, _ in _parts(hash_lists, _lengths(hash_lists)):
        part_low, part_high = (int(x) for x in _min_max(ids))
        low = part_low if high < 0 else min(low, part_low)
        high = max(high, part_high)
    return low, high


def _lengths(hash_lists: list[np.ndarray]) -> np.ndarray:
    return np.fromiter((len(h) for h in hash_lists), dtype=np.int64, count=len(hash_lists))


LONG_LISTS = 256  # ids a list holds on average from which the lists are read one by one


def _parts(hash_lists: list[np.ndarray], lengths: np.ndarray):
    """(ids, the lengths of the lists they hold), a part at a time, empty lists
    skipped: lists long on average (an agentic trace's whole contexts, thousands of
    ids each) one by one, where they lie; short ones (a published trace has millions)
    joined about CHECK_CHUNK ids at a time -- a compiled call or a reduction costs ~1 us
    whatever its length, a join a copy of every id."""
    if int(lengths.sum()) >= LONG_LISTS * len(lengths):
        for i in np.flatnonzero(lengths).tolist():
            yield hash_lists[i], lengths[i : i + 1]
        return
    for first, last in _chunks(lengths):
        yield np.concatenate(hash_lists[first:last]), lengths[first:last]


def _chunks(lengths: np.ndarray):
    """(first, last) ranges of lists holding about CHECK_CHUNK ids (at least one list
    each), those holding none skipped."""
    ends = np.cumsum(lengths)
    first, n = 0, len(lengths)
    while first < n:
        before = int(ends[first - 1]) if first else 0
        # lists up to and including the one that brings the chunk to CHECK_CHUNK ids
        last = max(int(np.searchsorted(ends, before + CHECK_CHUNK, side="left")) + 1,
                   first + 1)
        last = min(last, n)
        if ends[last - 1] > before:
            yield first, last
        first = last


def _agree(ids, lengths, position, before) -> bool:
    """Do the prompts `ids` (one after another, `lengths` long) agree with the
    position and predecessor (-1: none) each id was first seen with (`position` -1:
    not yet), recording those of ids seen the first time?"""
    found = _consistent(ids, lengths, position, before)
    if found < 0:
        raise ValueError("hash ids must be integers >= 0")
    return bool(found)


@njit(cache=True)
def _min_max(ids) -> tuple[int, int]:
    """(the smallest id, the largest) of a non-empty array, in one pass."""
    low = high = ids[0]
    for x in ids:
        if x < low:
            low = x
        elif x > high:
            high = x
    return low, high


@njit(cache=True)
def _consistent(ids, lengths, position, before) -> int:
    """`_agree` compiled: 1 yes, 0 no, -1 an id outside the tables."""
    i = 0
    for length in lengths:
        prev = -1
        for p in range(length):
            x = ids[i]
            i += 1
            if x < 0 or x >= len(position):
                return -1
            if position[x] == -1:
                position[x], before[x] = p, prev
            elif position[x] != p or before[x] != prev:
                return 0
            prev = x
    return 1


def _chain_labels(dense: np.ndarray, lengths: np.ndarray,
                  n_ids: int) -> tuple[np.ndarray, np.ndarray]:
    """Label each entry by its chain; also return each label's first flat index.

    Walk block positions 0, 1, 2, ...: at each, the entries of every prompt long
    enough, keyed by (label of the predecessor, raw id).
    """
    starts = np.cumsum(lengths) - lengths
    labels = np.empty(len(dense), dtype=np.int64)
    first_at = np.empty(len(dense), dtype=np.int64)  # per label; only [:next_label] used
    alive = np.flatnonzero(lengths > 0)             # prompts that reach this position
    next_label, position = 0, 0
    while len(alive):
        idx = starts[alive] + position   # ascending: prompts in file order
        # The predecessor of entry idx is idx - 1 (same prompt); at position 0 it
        # is "none" (-1). Labels are < len(dense), so the packed key fits in int64.
        pred = labels[idx - 1] if position else np.full(len(idx), -1, np.int64)
        key = (pred + 1) * n_ids + dense[idx]
        order = np.argsort(key)
        sorted_key = key[order]
        new_group = np.empty(len(key), dtype=bool)
        new_group[0] = True
        np.not_equal(sorted_key[1:], sorted_key[:-1], out=new_group[1:])
        group = np.cumsum(new_group) - 1
        labels[idx[order]] = next_label + group
        # First appearance of a group = its smallest idx (idx is ascending).
        n_groups = int(group[-1]) + 1
        first = np.minimum.reduceat(order, np.flatnonzero(new_group))
        first_at[next_label:next_label + n_groups] = idx[first]
        next_label += n_groups
        position += 1
        alive = alive[lengths[alive] > position]
    return labels, first_at[:next_label]


def _by_appearance(chosen: np.ndarray, first_at: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """The chosen chain labels, in order of first appearance (a mark-and-scan, no sort)."""
    marks = np.zeros(len(labels), dtype=bool)
    marks[first_at[chosen]] = True
    return labels[np.flatnonzero(marks)]  # the entry where a chain first appears is its own


def canonicalize(hash_lists: list[np.ndarray],
                 top: int | None = None) -> list[np.ndarray] | None:
    """Chain-unique copies of ``hash_lists``, or None when they already are (``top``:
    their largest id, where known)."""
    if is_chain_unique(hash_lists, top):
        return None
    dense, lengths, n_ids = _flatten(hash_lists)
    ids = np.concatenate(hash_lists)
    labels, first_at = _chain_labels(dense, lengths, n_ids)
    # For each raw id, the chain that appears first keeps it.
    chain_id = dense[first_at]
    earliest = np.full(n_ids, len(dense), dtype=np.int64)
    np.minimum.at(earliest, chain_id, first_at)
    renamed = _by_appearance(first_at != earliest[chain_id], first_at, labels)
    new_ids = ids[first_at]
    top = int(ids.max())
    if top + len(renamed) < MAX_HASH_ID:
        new_ids[renamed] = top + 1 + np.arange(len(renamed), dtype=np.int64)
    else:  # no room above the raw ids: number every chain by first appearance
        every = _by_appearance(np.ones(len(first_at), dtype=bool), first_at, labels)
        new_ids[every] = np.arange(len(first_at), dtype=np.int64)
    flat = new_ids[labels]
    return [part.copy() for part in np.split(flat, np.cumsum(lengths)[:-1])]
