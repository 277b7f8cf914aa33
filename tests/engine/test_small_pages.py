"""`small_pages.zeros`: numpy zeros whose memory is taken a small page at a time, as
written — a sparse write costs a page, not the 2 MiB huge page numpy asks for — and
`grow_in_place`, which lengthens one without a copy where nothing else holds its memory."""

import os

import numpy as np
import pytest

from labkit.engine import small_pages


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("shape, dtype", [((0,), np.int32), ((7,), np.int32),
                                          ((3, 5), np.int64), ((2, 4), np.float64)])
def test_they_are_writable_zeros_of_that_shape(shape, dtype):
    a = small_pages.zeros(shape, dtype)
    assert a.shape == shape and a.dtype == dtype and a.flags.writeable
    assert a.tobytes() == np.zeros(shape, dtype).tobytes()
    if a.size:
        a.reshape(-1)[-1] = 3
        assert a.reshape(-1)[-1] == 3 and a.sum() == 3


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="Linux only")
def test_a_sparse_write_costs_small_pages():
    # one write every 2 MiB of a 256 MiB array: 128 small pages (512 KiB); huge pages
    # would take 256 MiB (numpy's own array may, where the kernel grants them)
    a = small_pages.zeros((1 << 25,), np.int64)
    before = _rss_bytes()
    a[:: (2 << 20) // 8] = 1
    grown = _rss_bytes() - before
    assert a.sum() == 128
    assert grown < 16 << 20, grown


class _Owner:
    pass


def test_an_array_grows_in_place_keeping_what_it_holds():
    owner = _Owner()
    owner.a = small_pages.zeros(1000, np.int32)
    owner.a[[0, 999]] = [7, 9]
    assert small_pages.grow_in_place(owner, "a", 300_000)
    assert len(owner.a) == 300_000 and owner.a[0] == 7 and owner.a[999] == 9
    assert not owner.a[1000:].any()  # the new entries are zero
    owner.a[299_999] = 5  # and writable


def test_a_part_of_a_mapping_or_a_viewed_array_is_not_moved():
    owner = _Owner()
    owner.a = small_pages.zeros(1000, np.int32)[10:]  # (a part: not ours to move)
    assert not small_pages.grow_in_place(owner, "a", 5000) and len(owner.a) == 990
    owner.a = small_pages.zeros(1000, np.int32)
    owner.a[3] = 4
    view = owner.a[:10]  # (pins the mapping)
    assert not small_pages.grow_in_place(owner, "a", 5000)
    assert len(owner.a) == 1000 and owner.a[3] == 4 and view[3] == 4
    owner.a[3] = 6
    assert view[3] == 6  # the same memory, still
    owner.b = np.zeros(10)  # (numpy's memory)
    assert not small_pages.grow_in_place(owner, "b", 50)
