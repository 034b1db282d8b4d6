"""Stored values read with positioned reads (``pread``) rather than through LMDB's memory map.

LMDB hands a value out as a pointer into its read-only map, and py-lmdb touches every page of a value
it returns. Readers open shards with readahead off (samples are random), so on a cold page cache each
4 KB page of a value is a synchronous disk read of its own -- about 60 for one compressed 512 x 512
slice -- and a page once touched stays mapped: it counts in the process's memory (PSS) and the kernel
cannot drop it from the page cache. Even touching only the B-tree's pages through the map maps more
than them where the page cache holds the file in large folios (after any sequential read of it: a copy,
a verify): the kernel then maps a whole folio, up to 2 MB of values, on one fault.

So the slice sub-databases are searched here with positioned reads of their B-tree pages too: the
sub-database's root comes from its record in the main database (LMDB's own lookup), its branch pages
are kept per process, and a leaf page says where each value lies (a value of more than about 2 KB sits
on its own "overflow" pages: the leaf node holds their first page number and the value's size; a
smaller one sits in the leaf). The values' bytes are then read with one ``pread`` per run of values that
lie next to each other in the file (a series is written in one transaction, so a sample's slices
usually do) into a reusable per-thread buffer. :func:`advise_values` announces the runs of batches to
come with ``posix_fadvise(WILLNEED)``, so the kernel reads them from disk, many at once, while the
current batch decodes; kernel readahead stays off for the file (``POSIX_FADV_RANDOM``), so only the
pages asked for are read, and nothing of the file is ever mapped by these reads.

The page and node layouts are LMDB 0.9's on-disk format (``MDB_page``, ``MDB_node`` and ``MDB_db`` in
lmdb's mdb.c: a 16-byte page header with flags and the end of the node offsets, nodes of data size,
flags, key size, key and data; a branch node's child page number in its first three 16-bit words; an
overflow page's value after its 16-byte header). Each file is checked once per process: a value found
this way must equal the one LMDB returns. Positioned reads need POSIX ``preadv`` (Linux, macOS, BSDs).
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import lmdb
import numpy as np

from medload.errors import StoreError, StoreFormatError
from medload.storage.keys import slice_key

__all__ = ["Located", "ValueFile", "value_file", "forget", "locate", "coalesce", "read_values", "advise_values"]

_NODE = struct.Struct("=HHHH")   # MDB_node: data size (low, high 16 bits), flags, key size; the key follows
_PGNO = struct.Struct("=Q" if ctypes.sizeof(ctypes.c_size_t) == 8 else "=I")  # pgno_t (a size_t), after the key
_F_BIGDATA = 0x01
_OTHER_FLAGS = 0x06              # F_SUBDATA, F_DUPDATA: not in slice sub-databases
_PAGE_HEADER = 16                # an overflow page's header, before the value's bytes
_MAX_READ = 8 << 20              # bytes one pread reads at most (a longer run is read in pieces)
_GAP = 8192                      # values at most this far apart are read in one run (the gap is read too)


@dataclass(frozen=True)
class Located:
    """A stored value found in the B-tree: slice ``z``, the value's offset in the data file, its length."""

    z: int
    length: int
    offset: int


_P_BRANCH, _P_LEAF = 0x01, 0x02
_PAGE = struct.Struct("=QHHHH")   # MDB_page: page number, pad, flags, lower (end of node offsets), upper
_DB_ROOT = 40                     # offset of md_root in an MDB_db record
_INVALID = 2**64 - 1              # P_INVALID: the root of an empty database


class _Page:
    """One B-tree page, parsed: whether it is a leaf, and per node its key and its header's fields."""

    __slots__ = ("pgno", "leaf", "keys", "nodes", "data")

    def __init__(self, pgno: int, page: bytes, path: Path) -> None:
        _, _, flags, lower, _ = _PAGE.unpack_from(page)
        if flags & 0x7F not in (_P_BRANCH, _P_LEAF) or not _PAGE.size <= lower <= len(page):
            raise StoreFormatError(f"{path}: page {pgno} is neither a branch nor a leaf page (flags {flags:#x}): "
                                   "the shard is damaged; run `medload verify`")
        n = (lower - _PAGE.size) >> 1
        self.pgno, self.leaf, self.data = pgno, flags & _P_LEAF == _P_LEAF, []
        try:
            ptrs = struct.unpack_from(f"={n}H", page, _PAGE.size)
            self.nodes = [_NODE.unpack_from(page, ptr) for ptr in ptrs]      # (lo, hi, flags, key size)
            self.keys = [page[ptr + _NODE.size : ptr + _NODE.size + node[3]] for ptr, node in zip(ptrs, self.nodes)]
            if self.leaf:  # where each node's data start: a value, or the page number of its overflow pages
                self.data = [ptr + _NODE.size + node[3] for ptr, node in zip(ptrs, self.nodes)]
                self.data = [(_PGNO.unpack_from(page, d)[0] if node[2] & _F_BIGDATA else None, d)
                             for d, node in zip(self.data, self.nodes)]
        except struct.error:
            raise StoreFormatError(f"{path}: a node of page {pgno} lies outside the page: the shard is damaged; "
                                   "run `medload verify`") from None
        if not self.leaf and not self.nodes:
            raise StoreFormatError(f"{path}: branch page {pgno} has no nodes: the shard is damaged; run `medload verify`")


class _Tree:
    """One sub-database's B-tree in one file, searched with positioned reads of its pages (branch pages
    kept, the last ``_LEAVES`` leaf pages too)."""

    _LEAVES = 256

    def __init__(self, vf: ValueFile, root: int) -> None:
        self.vf, self.root = vf, root
        self.branches: dict[int, _Page] = {}
        self.leaves: OrderedDict[int, _Page] = OrderedDict()
        self.lock = threading.Lock()

    def _page(self, pgno: int) -> _Page:
        with self.lock:
            page = self.branches.get(pgno) or self.leaves.get(pgno)
        if page is None:
            size = self.vf.page_size
            page = _Page(pgno, bytes(_read_exactly(self.vf.fd, pgno * size, size, self.vf.path)), self.vf.path)
            with self.lock:
                if page.leaf:
                    self.leaves[pgno] = page
                    while len(self.leaves) > self._LEAVES:
                        self.leaves.popitem(last=False)
                else:
                    self.branches[pgno] = page
        return page

    def leaf(self, key: bytes) -> tuple[_Page, int]:
        """The leaf page that holds ``key`` (if it is stored), and the index of its first node whose key is
        not less than ``key``. In a branch, node i leads to the keys from its own on (node 0: all smaller)."""
        page = self._page(self.root)
        while not page.leaf:
            lo, hi, flags, _ = page.nodes[max(0, bisect_right(page.keys, key) - 1)]
            page = self._page(lo | hi << 16 | flags << 32)
        return page, bisect_left(page.keys, key)


def locate(tree: _Tree, key: bytes, z0: int, z1: int) -> list[Located]:
    """Slices ``z0 <= z < z1`` of series ``key``: where each value lies in the file (only the tree's
    pages are read)."""
    found: list[Located] = []
    size = tree.vf.page_size
    z = z0
    while z < z1:
        page, i = tree.leaf(slice_key(key, z))
        n = len(page.keys)
        if i == n:
            raise StoreError(f"series {key.hex()[:12]} is missing slice {z}: the store is damaged; run `medload verify`")
        while z < z1 and i < n:
            if page.keys[i] != slice_key(key, z):
                raise StoreError(f"series {key.hex()[:12]} is missing slice {z}: the store is damaged; "
                                 "run `medload verify`")
            lo, hi, flags, _ = page.nodes[i]
            if flags & _OTHER_FLAGS:
                raise StoreFormatError(f"slice {z} of series {key.hex()[:12]}: its LMDB leaf node has flags "
                                       f"{flags:#x}, which slice sub-databases never use; run `medload verify`")
            first, start = page.data[i]
            offset = first * size + _PAGE_HEADER if first is not None else page.pgno * size + start
            found.append(Located(z, lo | hi << 16, offset))
            z, i = z + 1, i + 1
    return found


def coalesce(spans: list[tuple[int, int]], max_bytes: int = _MAX_READ) -> list[tuple[int, int, list[int]]]:
    """Runs ``(start, end, members)`` covering the ``(offset, length)`` spans: a span that starts within
    ``_GAP`` bytes after the previous one ends shares its run (LMDB starts each large value on a fresh
    page, after the page's header), as long as the run stays under ``max_bytes``; ``members`` are the
    spans' positions in ``spans``, in file order."""
    runs: list[tuple[int, int, list[int]]] = []
    for i in sorted(range(len(spans)), key=lambda i: spans[i][0]):
        start, length = spans[i]
        end = start + length
        if runs and 0 <= start - runs[-1][1] < _GAP and end - runs[-1][0] <= max_bytes:
            runs[-1] = (runs[-1][0], end, runs[-1][2] + [i])
        else:
            runs.append((start, end, [i]))
    return runs


class ValueFile:
    """One shard file in this process: a descriptor with kernel readahead off, its page size, and the
    B-trees of the sub-databases read so far."""

    def __init__(self, path: Path, page_size: int) -> None:
        self.path, self.page_size = path, page_size
        self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
        self.size = os.fstat(self.fd).st_size
        self.trees: dict[bytes, _Tree] = {}
        self.checked = False

    def close(self) -> None:
        os.close(self.fd)

    def tree(self, env: lmdb.Environment, name: bytes) -> _Tree:
        """The B-tree of sub-database ``name``, its root read from its record in the main database."""
        tree = self.trees.get(name)
        if tree is None:
            with env.begin(buffers=True) as txn:
                record = txn.get(name)
            if record is None or len(record) < _DB_ROOT + _PGNO.size:
                raise StoreError(f"sub-database {name.decode()} is missing from {self.path}: the store is damaged; "
                                 "run `medload verify`")
            (root,) = _PGNO.unpack_from(record, _DB_ROOT)
            tree = self.trees[name] = _Tree(self, root)
        if tree.root == _INVALID:
            raise StoreError(f"sub-database {name.decode()} of {self.path} is empty: the store is damaged; "
                             "run `medload verify`")
        return tree

    def _spans(self, found: list[Located]) -> list[tuple[int, int]]:
        spans = [(v.offset, v.length) for v in found]
        for (offset, length), v in zip(spans, found):
            if offset + length > self.size:
                raise StoreError(f"slice {v.z} lies past the end of {self.path} ({self.size} bytes): the shard is "
                                 "damaged or truncated; run `medload verify`")
        return spans

    def advise(self, found: list[Located]) -> None:
        """Ask the kernel to read these values into the page cache now, without waiting for them."""
        if found and hasattr(os, "posix_fadvise"):
            for start, end, _ in coalesce(self._spans(found)):
                os.posix_fadvise(self.fd, start, end - start, os.POSIX_FADV_WILLNEED)

    def read(self, found: list[Located]) -> Iterator[tuple[int, memoryview]]:
        """Yield ``(i, view)`` for each located value: its bytes, read with one pread per run into this
        thread's buffer (a view is valid until the thread reads the next run)."""
        spans = self._spans(found)
        for start, end, members in coalesce(spans):
            view = _read_exactly(self.fd, start, end - start, self.path)
            for i in members:
                offset, length = spans[i]
                yield i, view[offset - start : offset - start + length]

    def check(self, env: lmdb.Environment, name: bytes, key: bytes, value: Located) -> None:
        """Once per process: a value found by reading the tree here equals what LMDB returns for its key."""
        if self.checked:
            return
        with env.begin() as txn:
            expected = txn.get(slice_key(key, value.z), db=env.open_db(name, txn=txn, create=False))
        got = bytes(_read_exactly(self.fd, value.offset, value.length, self.path))
        if expected != got:
            raise StoreFormatError(f"{self.path}: a value found by reading LMDB's pages differs from the one LMDB "
                                   "returns (a format medload does not know?); run `medload verify`")
        self.checked = True


_local = threading.local()


def _read_exactly(fd: int, start: int, nbytes: int, path: Path) -> memoryview:
    """``nbytes`` from ``start``, read into this thread's buffer (one per thread, for every file)."""
    buf = getattr(_local, "buf", None)
    if buf is None or len(buf) < nbytes:
        buf = _local.buf = bytearray(max(nbytes, 1 << 20))
    view = memoryview(buf)[:nbytes]
    got = 0
    while got < nbytes:
        more = os.preadv(fd, [view[got:]], start + got)
        if more <= 0:
            raise StoreError(f"{path} ended at byte {start + got} while reading slice values: the shard is damaged "
                             "or truncated; run `medload verify`")
        got += more
    return view


_files: dict[Path, ValueFile] = {}
_files_pid = os.getpid()
_files_lock = threading.Lock()


def _forget_after_fork() -> None:
    global _files_lock
    _files_lock = threading.Lock()  # a thread of the parent may have held it at the fork


os.register_at_fork(after_in_child=_forget_after_fork)


def _data_file(path: Path) -> Path:
    return (path if path.suffix == ".mdb" else path / "data.mdb").absolute()


def value_file(path: Path, env: lmdb.Environment) -> ValueFile:
    """The :class:`ValueFile` of the shard at ``path`` (a shard directory or a single-file copy), opened
    once per process; after a ``fork`` the child opens its own."""
    global _files_pid
    data = _data_file(path)
    with _files_lock:
        if _files_pid != os.getpid():
            _files.clear()
            _files_pid = os.getpid()
        vf = _files.get(data)
        if vf is None:
            vf = _files[data] = ValueFile(data, env.stat()["psize"])
        return vf


def forget(path: Path) -> None:
    """Close this process's descriptor on a shard's data file (its environment is being closed)."""
    with _files_lock:
        vf = _files.pop(_data_file(path), None) if _files_pid == os.getpid() else None
    if vf is not None:
        vf.close()


def read_values(env: lmdb.Environment, path: Path, db_name: bytes, key: bytes, z0: int, z1: int,
                targets: list[np.ndarray], verify: bool, on_decode: Callable[[float], None] | None = None) -> int:
    """Decode slices ``z0..z1-1`` of series ``key`` into ``targets`` (one C-contiguous 2-D array each):
    found by reading the tree's pages, read with one pread per run of neighbouring values; returns the
    bytes of stored values read. ``on_decode``: as :func:`~medload.storage.codec.decode_value`'s."""
    from medload.storage.codec import decode_value, value_shape

    vf = value_file(path, env)
    found = locate(vf.tree(env, db_name), key, z0, z1)
    vf.check(env, db_name, key, found[0])
    for i, view in vf.read(found):
        out = targets[i]
        if value_shape(view) != out.shape:
            raise StoreError(f"slice {z0 + i} of series {key.hex()[:12]} has shape {value_shape(view)}, "
                             f"record says {out.shape}: the store is damaged; run `medload verify`")
        decode_value(view, verify=verify, out=out, on_decode=on_decode)
    return sum(v.length for v in found)


def advise_values(env: lmdb.Environment, path: Path, db_name: bytes, runs: list[tuple[bytes, int, int]]) -> None:
    """Have the kernel start reading the values of ``runs`` (``(series key, z0, z1)`` each) from disk."""
    vf = value_file(path, env)
    tree = vf.tree(env, db_name)
    vf.advise([v for key, z0, z1 in runs for v in locate(tree, key, z0, z1)])
