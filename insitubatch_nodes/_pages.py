"""Fresh process memory for pool slots and batch buffers, and how its pages are asked for.

Everything a cold epoch keeps — pool slots, batch buffers — is memory the process has never
touched, paid for page by page on first write. Two rules, both measured on the project's VM
(docs/pipeline.md, *Memory paid for once*):

* **No huge-page request.** numpy asks the kernel for transparent huge pages
  (``madvise(MADV_HUGEPAGE)``) on every array of 4 MiB or more. Where the memory behind a huge
  page has to be backed anew (a VM whose host reclaims the guest's free memory: the free
  blocks large enough for a huge page are exactly those), each first write of 2 MiB waits for
  it: an epoch 0 of the 16-samples-per-chunk archive store whose slots were all made on demand
  took 5.2–5.8 s with numpy's request and 1.5–3.8 s without it (four fresh processes each).
  :func:`plain_pages` maps such memory without the request: the kernel's own policy decides.
* **Populated in one pass where that is paid ahead of need.** :func:`populated_pages` maps the
  range with ``MAP_POPULATE``, several times as fast as first writes faulting it in.

Smaller arrays come from numpy's heap: mapped alone, a 512-byte chunk's slot held a 4 KiB page
(:data:`OWN_MAPPING_MIN_BYTES`), and numpy asks for no huge pages below
:data:`NUMPY_HUGE_PAGE_BYTES`.
"""

from __future__ import annotations

import math
import mmap
import sys
from typing import Any

import numpy as np

__all__ = ["NUMPY_HUGE_PAGE_BYTES", "OWN_MAPPING_MIN_BYTES", "plain_pages", "populated_pages"]

#: Smallest array given a mapping of its own: 16 pages, so that the rest of its last page is at
#: most 1/16 of it (the heap holds smaller arrays tightly).
OWN_MAPPING_MIN_BYTES = 16 * mmap.PAGESIZE

#: The size from which numpy asks for huge pages (numpy's ``alloc.c``: ``>= 1 << 22``).
NUMPY_HUGE_PAGE_BYTES = 4 << 20

_LINUX = sys.platform.startswith("linux")
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def _mapped(nbytes: int, flags: int) -> np.ndarray:
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | flags)
    return np.frombuffer(region, dtype=np.uint8)  # unmapped once the last view is dropped


def plain_pages(shape: tuple[int, ...], dtype: np.dtype[Any] | type) -> np.ndarray:
    """An uninitialised C-ordered array of ``shape``, its pages faulted in on first write (as
    ``np.empty``), without asking for huge pages (module docstring). Writable. On Linux, from
    :data:`NUMPY_HUGE_PAGE_BYTES` up, a mapping of its own (unmapped when the array is
    dropped; ``np.empty`` where the kernel refuses one more mapping)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if _LINUX and nbytes >= NUMPY_HUGE_PAGE_BYTES:
        try:
            return _mapped(nbytes, 0).view(dtype).reshape(shape)
        except OSError:  # (vm.max_map_count reached): numpy's heap, huge pages and all
            pass
    return np.empty(shape, dtype=dtype)


def populated_pages(shape: tuple[int, ...], dtype: np.dtype[Any] | type) -> np.ndarray:
    """An array of ``shape`` whose pages are already faulted in (zeros): one anonymous ``mmap``
    with ``MAP_POPULATE`` on Linux, where the kernel maps the whole range in one pass (measured
    on the project's VM: ~3–4 GB/s against 0.2–2 GB/s for first writes); elsewhere, and below
    :data:`OWN_MAPPING_MIN_BYTES`, zeros written into a fresh array by the calling thread."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if not _LINUX or not _POPULATE or nbytes < OWN_MAPPING_MIN_BYTES:
        out = np.empty(shape, dtype=dtype)
        out.fill(0)
        return out
    return _mapped(nbytes, _POPULATE).view(dtype).reshape(shape)
