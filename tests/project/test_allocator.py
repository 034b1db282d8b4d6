"""medload.allocator: after keep_large_buffers_in_heap, slice-sized buffers come from the heap, not mmap."""

from __future__ import annotations

import subprocess
import sys

import pytest

_PROBE = """
import ctypes, sys

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

def mapped_by(size):  # bytes malloc serves with mmap of its own while a block of `size` is held
    before = libc.mallinfo2().hblkhd
    block = libc.malloc(size)
    after = libc.mallinfo2().hblkhd
    libc.free(block)
    return after - before

if sys.argv[1] == "tune":  # one block per process: glibc raises its own threshold after freeing a mapped one
    from medload.allocator import keep_large_buffers_in_heap
    keep_large_buffers_in_heap()
print(mapped_by(8 << 20))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt and mallinfo2 are glibc's (Linux)")
def test_slice_sized_buffers_stay_in_the_heap_once_tuned():
    def probe(mode: str) -> int:
        return int(subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True,
                                  check=True).stdout)

    assert probe("none") >= 8 << 20  # glibc's default: an 8 MB block is a mapping of its own, unmapped on free
    assert probe("tune") == 0  # tuned: served from the heap, and kept there for reuse
