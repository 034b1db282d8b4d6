"""Which pages of a file are in the page cache (``mincore`` on a fresh read-only mapping, which maps
but does not read them), and dropping them: what the tests of read-ahead and cold reads look at."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
PAGE = os.sysconf("SC_PAGE_SIZE")


def resident(path: Path, start: int = 0, length: int | None = None) -> float:
    """Fraction of the pages of ``path[start:start + length]`` (default: all of it) in the page cache."""
    size = os.path.getsize(path)
    length = size - start if length is None else length
    first, last = start // PAGE, (start + length - 1) // PAGE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        try:
            vec = (ctypes.c_ubyte * (last - first + 1))()
            if _libc.mincore(addr + first * PAGE, (last - first + 1) * PAGE, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            return sum(v & 1 for v in vec) / len(vec)
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def drop(path: Path) -> bool:
    """Drop ``path``'s pages from the page cache; whether they are gone (tmpfs, for one, keeps them, and
    the kernel keeps pages some process has mapped)."""
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return resident(path) < 0.05
