"""Fresh memory for slots and batch buffers asks the kernel for no huge pages
(``insitubatch_nodes/_pages.py``): the claims, read from the kernel's own view of this process's
mappings (``/proc/self/smaps``: ``hg`` among a mapping's ``VmFlags`` is ``MADV_HUGEPAGE``)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from insitubatch_nodes._pages import NUMPY_HUGE_PAGE_BYTES, plain_pages, populated_pages
from insitubatch_nodes.lending import BufferPool
from insitubatch_nodes.slots import RamBacking

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps"),
]


def _vm_flags(arr: np.ndarray) -> list[str]:
    """The ``VmFlags`` of the mapping that holds ``arr``'s middle byte (numpy advises huge
    pages from the first page boundary inside an array on: its first page may lie apart)."""
    address = arr.__array_interface__["data"][0] + arr.nbytes // 2
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError("no mapping holds the array")


def _numpy_asks_for_huge_pages() -> bool:
    try:
        from numpy._core.multiarray import _get_madvise_hugepage
    except ImportError:  # pragma: no cover - numpy < 2
        from numpy.core.multiarray import _get_madvise_hugepage
    return bool(_get_madvise_hugepage())


def test_a_large_numpy_array_asks_for_huge_pages_which_is_what_slots_avoid() -> None:
    if not _numpy_asks_for_huge_pages():
        pytest.skip("numpy's huge-page request is off here (NUMPY_MADVISE_HUGEPAGE=0)")
    assert "hg" in _vm_flags(np.empty(NUMPY_HUGE_PAGE_BYTES, np.uint8))


def test_slots_of_every_size_ask_for_no_huge_pages_and_read_back_what_was_written() -> None:
    backing = RamBacking()
    for shape in [(3, 5, 7), (NUMPY_HUGE_PAGE_BYTES // 4,), (2, 3, 1 << 20)]:
        for make in (backing.allocate, backing.allocate_populated):
            slot = make(shape, np.dtype("f4"))
            assert slot.shape == shape and slot.dtype == np.dtype("f4")
            assert slot.flags.c_contiguous and slot.flags.writeable
            if slot.nbytes >= NUMPY_HUGE_PAGE_BYTES:
                # (a smaller slot comes from numpy's heap, as any small array: once the fetch
                # stage's allocator tuning has raised glibc's mmap threshold, numpy's larger
                # arrays come from that heap too, and the huge-page request numpy makes for
                # them stays on the heap's range, so a later small slot may land in it)
                assert "hg" not in _vm_flags(slot)
            slot[...] = np.arange(slot.size, dtype="f4").reshape(shape)
            assert slot.reshape(-1)[-1] == slot.size - 1


def test_populated_pages_hold_zeros_and_plain_pages_are_uninitialised_but_writable() -> None:
    populated = populated_pages((NUMPY_HUGE_PAGE_BYTES,), np.uint8)
    assert not populated.any()
    plain = plain_pages((2, NUMPY_HUGE_PAGE_BYTES // 8), np.dtype("<f8"))
    plain.fill(1.5)
    assert float(plain.sum()) == 1.5 * plain.size


def test_a_batch_buffer_made_on_demand_asks_for_no_huge_pages() -> None:
    pool = BufferPool((8, NUMPY_HUGE_PAGE_BYTES // 32), np.dtype("f4"))
    lent = pool.take()
    assert lent.nbytes == NUMPY_HUGE_PAGE_BYTES
    assert "hg" not in _vm_flags(lent)
