"""Large results in transparent huge pages.

A new array of tens of megabytes (a batch's activations) is fresh memory from the system: the first
write to each of its 4 KiB pages faults, and the kernel maps and zeroes it, page by page. For a
38.5 MB output that cost 11 ms on top of the 1.6 ms the write itself takes (Zen 4; glibc maps every
allocation past 32 MB anew and unmaps it when freed, so each call pays it again). Linux maps memory
that `madvise(MADV_HUGEPAGE)` marks in 2 MiB pages instead (where transparent huge pages are
"always" or "madvise", the common defaults): the same first write took 4 ms. `advise_huge_pages`
marks the whole 2 MiB pages inside a result before the kernels write it; elsewhere (another system,
THP "never", an error) it does nothing. NumPy marks its own large arrays so already; PyTorch does not,
so `convgen.torch` marks the tensors it makes for results.
"""

from __future__ import annotations

import ctypes
import sys

HUGE_PAGE = 2 << 20
# Results smaller than this are left alone: they come from the allocator's own reused memory.
MIN_BYTES = 4 * HUGE_PAGE
_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


_MADVISE = None  # libc's madvise, looked up on the first large result (False: not to be had here)


def _madvise():
    """libc's madvise from the symbols the process has loaded already (no search for the library,
    which runs ldconfig), once; False off Linux or where it cannot be had."""
    global _MADVISE
    if _MADVISE is None:
        _MADVISE = False
        if sys.platform.startswith("linux"):
            try:
                function = ctypes.CDLL(None).madvise
            except (OSError, AttributeError):
                return _MADVISE
            function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            function.restype = ctypes.c_int
            _MADVISE = function
    return _MADVISE


def advise_huge_pages(address: int, nbytes: int) -> None:
    """Ask for the 2 MiB pages wholly inside [address, address + nbytes) to be mapped as huge pages
    when first written (results of MIN_BYTES or more; a no-op elsewhere). Never fails."""
    if nbytes < MIN_BYTES:
        return
    madvise = _madvise()
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    if madvise and end > start:
        madvise(start, end - start, _MADV_HUGEPAGE)  # (an error leaves the pages as they were)


__all__ = ["HUGE_PAGE", "MIN_BYTES", "advise_huge_pages"]
