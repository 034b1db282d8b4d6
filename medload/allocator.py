"""Process memory tuning: keep large buffers in the C heap for reuse.

Ingest decodes slices into 0.5-2 MB buffers and training builds 10-50 MB batches, one after another.
By default glibc serves every allocation above 128 KB with a fresh ``mmap`` and returns it with
``munmap`` on free, so each slice or batch pays page faults and kernel zeroing again.
``benchmarks/memory.py`` on synthetic 512x512 slices: file read 305 -> 78 us and HU decode 125 -> 77
us per slice on a first pass, decode 106 -> 76 us once glibc's own threshold has adapted. Raising
the mmap threshold (``M_MMAP_THRESHOLD``, -3) to its 32 MB maximum and the trim threshold
(``M_TRIM_THRESHOLD``, -1) keeps such buffers in the heap for reuse, at the cost of the process
keeping up to ~128 MB it freed. No effect where the C library is not glibc.

Applied only in processes medload owns (the ``medload`` command, ingest workers): it changes malloc
for the whole process, and with large allocations of varying lifetimes -- a training loop's float
batches -- a fixed high threshold can let the heap grow to gigabytes of free but unreturned memory
(seen here). The training loader avoids that churn by recycling its batch buffers instead.
"""

from __future__ import annotations

import ctypes

__all__ = ["keep_large_buffers_in_heap"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_large_buffers_in_heap() -> None:
    """Apply the tuning above to this process (idempotent)."""
    try:  # the process's own symbols: ctypes.util.find_library("c") runs `ldconfig -p`, a process per call
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
        libc.mallopt(_M_TRIM_THRESHOLD, 128 << 20)
    except (OSError, AttributeError):
        pass
