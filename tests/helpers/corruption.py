"""Damage done to a real store for the corruption matrix (tests/storage/test_corruption.py): each function damages
one store in place, as bit rot, a failed copy or an operator's mistake would, and returns the shards it
damaged (empty for store.json damage).

LMDB's on-disk layout used here (lmdb's mdb.c, 64-bit): a page starts with a 16-byte header (page number
u64, pad u16, flags u16, lower u16, upper u16) and, in a branch or leaf page, the u16 offsets of its
nodes; a branch node starts with its child's page number in three u16 words (low, high, top). Pages 0
and 1 are the two meta pages; LMDB uses the one with the larger transaction id (its last u64 field).
"""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

import lmdb

from medload.storage.keys import slice_key
from medload.storage.manifest import ShardEntry, manifest_path, read_manifest, shard_path

__all__ = ["DAMAGE", "flip_meta_page", "flip_branch_page", "flip_value", "truncate_half", "truncate_4k",
           "truncate_zero", "delete_shard_dir", "delete_data_mdb", "truncate_store_json", "swap_two_shards"]

_PAGE = 4096
_P_BRANCH = 0x01
_META_TXNID = 16 + 4 + 4 + 8 + 8 + 2 * 48 + 8  # header, magic, version, address, mapsize, two MDB_db, last_pgno


def _data(root: Path, entry: ShardEntry) -> Path:
    return shard_path(root, entry.name) / "data.mdb"


def _victim(root: Path) -> ShardEntry:
    """The shard the matrix damages: the second of the store (neither its first nor its last)."""
    return read_manifest(root).shards[1]


def _xor(path: Path, offset: int, mask: bytes) -> None:
    data = bytearray(path.read_bytes())
    for i, m in enumerate(mask):
        data[offset + i] ^= m
    path.write_bytes(bytes(data))


def flip_meta_page(root: Path) -> list[str]:
    """Flip the magic number of the meta page LMDB would use (the one with the larger txnid)."""
    entry = _victim(root)
    data = _data(root, entry).read_bytes()
    txnids = [struct.unpack_from("=Q", data, page * _PAGE + _META_TXNID)[0] for page in (0, 1)]
    _xor(_data(root, entry), txnids.index(max(txnids)) * _PAGE + 16, b"\xff\xff\xff\xff")
    return [entry.name]


def _slices_root(path: Path) -> tuple[int, int]:
    """Root page number and depth of the ``slices`` sub-database of a shard directory."""
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=64)
    try:
        with env.begin() as txn:
            record = txn.get(b"slices")
            depth = txn.stat(env.open_db(b"slices", txn=txn, create=False))["depth"]
    finally:
        env.close()
    return struct.unpack_from("=Q", record, 40)[0], depth


def flip_branch_page(root: Path) -> list[str]:
    """Flip a bit in the child page number of every node of the root (a branch page) of the ``slices``
    B-tree: each now points 2**16 pages further, past the end of the file."""
    entry = _victim(root)
    page, depth = _slices_root(shard_path(root, entry.name))
    data = _data(root, entry).read_bytes()
    flags, lower = struct.unpack_from("=HH", data, page * _PAGE + 10)
    if depth < 2 or not flags & _P_BRANCH:
        raise AssertionError(f"the slices B-tree of shard {entry.name} has no branch page: make the store larger")
    for i in range(16, lower, 2):
        node = page * _PAGE + struct.unpack_from("=H", data, page * _PAGE + i)[0]
        _xor(_data(root, entry), node + 2, b"\x01")  # bit 16 of the child's page number
    return [entry.name]


def flip_value(root: Path) -> list[str]:
    """Flip one bit in the middle of slice 3 of the first series of the shard, in every copy LMDB keeps."""
    entry = _victim(root)
    path = shard_path(root, entry.name)
    key = slice_key(bytes.fromhex(entry.keys.series[0]), 3)
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=64)
    try:
        with env.begin() as txn:
            value = bytes(txn.get(key, db=env.open_db(b"slices", txn=txn, create=False)))
    finally:
        env.close()
    data = bytearray(_data(root, entry).read_bytes())
    at = data.find(value)
    if at < 0:
        raise AssertionError("the value is not stored contiguously")
    while at >= 0:
        data[at + len(value) // 2] ^= 0x40
        at = data.find(value, at + 1)
    _data(root, entry).write_bytes(bytes(data))
    return [entry.name]


def truncate_half(root: Path) -> list[str]:
    entry = _victim(root)
    os.truncate(_data(root, entry), entry.bytes // 2)
    return [entry.name]


def truncate_4k(root: Path) -> list[str]:
    entry = _victim(root)
    os.truncate(_data(root, entry), 4096)
    return [entry.name]


def truncate_zero(root: Path) -> list[str]:
    entry = _victim(root)
    os.truncate(_data(root, entry), 0)
    return [entry.name]


def delete_shard_dir(root: Path) -> list[str]:
    entry = _victim(root)
    shutil.rmtree(shard_path(root, entry.name))
    return [entry.name]


def delete_data_mdb(root: Path) -> list[str]:
    entry = _victim(root)
    _data(root, entry).unlink()
    return [entry.name]


def truncate_store_json(root: Path) -> list[str]:
    path = manifest_path(root)
    os.truncate(path, path.stat().st_size // 2)
    return []


def swap_two_shards(root: Path) -> list[str]:
    """Swap the data files of the first two shards (of equal size here: only their records tell them apart)."""
    a, b = read_manifest(root).shards[:2]
    tmp = _data(root, a).with_name("swap.tmp")
    os.replace(_data(root, a), tmp)
    os.replace(_data(root, b), _data(root, a))
    os.replace(tmp, _data(root, b))
    return [a.name, b.name]


DAMAGE = {fn.__name__: fn for fn in (flip_meta_page, flip_branch_page, flip_value, truncate_half, truncate_4k,
                                     truncate_zero, delete_shard_dir, delete_data_mdb, truncate_store_json,
                                     swap_two_shards)}
