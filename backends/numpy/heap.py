"""How the numpy backend's process keeps its large temporaries: in glibc's heap, for reuse.

A forward pass allocates and frees the same multi-MB arrays at every call (a batch's
activations, an expert's gathered rows, the attention's scores). glibc's malloc maps each
block over its mmap threshold afresh and unmaps it when freed, so every call faults in and
zeroes new pages. Its own dynamic rule raises the threshold to the size of a mapped block once
one is freed (up to 32 MB) and the heap's trim threshold to twice that; until the process has
freed a large enough block, though, the temporaries of each pass fault in anew. On the
mixture-of-experts bench that cost 7% of teacher forcing's speed (242 -> 225 tok/s, Q4_K,
docs/bench-moe.md). :func:`keep_large_buffers` sets both thresholds where that rule would
end, at the first numpy backend. It changes no number: only where freed memory waits.
"""

from __future__ import annotations

import ctypes
import functools
import sys

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit machines


@functools.cache
def keep_large_buffers() -> bool:
    """Keep blocks up to 32 MB in the heap, and up to 64 MB of freed heap before giving it
    back (process-wide, once); whether it was done (glibc only: elsewhere, nothing)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # no C library to ask, or not glibc's
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD)
    )
