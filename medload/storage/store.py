"""Reading a store: series records, slab reads as one cursor range scan, quarantine records.

A :class:`Store` is safe to hand to DataLoader workers under ``fork`` and ``spawn``: it pickles to its
path, and LMDB environments are opened lazily in the process that uses them, once per process for all
Store objects (a pid check reopens them after a fork, following py-lmdb's rule that an environment is
never used across ``fork``).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import lmdb
import numpy as np

from medload import windows
from medload.errors import ConfigError, SeriesNotFoundError, StoreError
from medload.storage import shard as sh
from medload.storage.codec import decode_value, value_shape
from medload.storage.keys import SERIES_KEY_BYTES, slice_key, split_slice_key
from medload.storage.manifest import Manifest, read_manifest, shard_path
from medload.storage.records import RejectRecord, SeriesRecord

__all__ = ["Store", "open_store"]

_NUMPY_DTYPES = {"int16": np.int16, "float32": np.float32, "uint8": np.uint8, "uint16": np.uint16}


def open_store(path: str | os.PathLike) -> Store:
    """Open the store at ``path`` for reading.

    Example:
        >>> store = medload.open_store("stores/sample")        # doctest: +SKIP
        >>> rec = store.series()[0]; vol = store.read(rec.key)  # (slices, rows, columns) HU int16
    """
    return Store(path)


class Store:
    """Read access to a medload store (see :func:`open_store`)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.manifest: Manifest = read_manifest(self.path)
        self._records: dict[bytes, SeriesRecord] | None = None

    # ---- pickling and fork safety -----------------------------------------------------------
    def __getstate__(self) -> dict:
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])

    def _env(self, shard_name: str) -> lmdb.Environment:
        return sh.reader_env(shard_path(self.path, shard_name))

    def close(self) -> None:
        """Close this process's LMDB handles on the store's shards (other Store objects of the same
        store reopen them on their next read)."""
        sh.close_reader_envs([shard_path(self.path, s.name) for s in self.manifest.shards])

    def refresh(self) -> None:
        """Re-read ``store.json`` to see shards published since the store was opened."""
        self.manifest = read_manifest(self.path)
        self._records = None

    # ---- records -----------------------------------------------------------------------------
    def _all_records(self) -> dict[bytes, SeriesRecord]:
        if self._records is None:
            records: dict[bytes, SeriesRecord] = {}
            for entry in self.manifest.shards:
                env = self._env(entry.name)
                with env.begin(buffers=True) as txn:
                    dbs = sh.open_dbs(env, [sh.SERIES], create=False, txn=txn)
                    for k, v in txn.cursor(db=dbs[sh.SERIES]):
                        records[bytes(k)] = replace(SeriesRecord.from_json(bytes(v)), shard=entry.name)
            self._records = dict(sorted(records.items()))
        return self._records

    def series(self) -> list[SeriesRecord]:
        """Records of every stored volume, sorted by key."""
        return list(self._all_records().values())

    def record(self, key: str | bytes) -> SeriesRecord:
        """The record of one series, by key bytes, full hex key or a unique hex prefix."""
        records = self._all_records()
        if isinstance(key, bytes):
            if key in records:
                return records[key]
            raise SeriesNotFoundError(f"no series {key.hex()} in {self.path}: list them with `medload ls {self.path}`")
        text = key.lower()
        if len(text) == 2 * SERIES_KEY_BYTES and bytes.fromhex(text) in records:
            return records[bytes.fromhex(text)]
        matches = [r for k, r in records.items() if k.hex().startswith(text)] if text else []
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise SeriesNotFoundError(f"no series key starts with {key!r} in {self.path}: list them with `medload ls {self.path}`")
        raise SeriesNotFoundError(f"{len(matches)} series keys start with {key!r}: give more digits")

    def rejects(self, *, include_skipped: bool = True) -> list[RejectRecord]:
        """Quarantine records: inputs that were rejected (and, by default, skipped), sorted by source."""
        out = []
        for entry in self.manifest.shards:
            env = self._env(entry.name)
            with env.begin(buffers=True) as txn:
                dbs = sh.open_dbs(env, [sh.REJECTS], create=False, txn=txn)
                if sh.REJECTS in dbs:
                    out.extend(RejectRecord.from_json(bytes(v)) for v in txn.cursor(db=dbs[sh.REJECTS]).iternext(keys=False))
        if not include_skipped:
            out = [r for r in out if r.status != "skipped"]
        return sorted(out, key=lambda r: (r.source, r.stage, r.reason))

    # ---- slices ------------------------------------------------------------------------------
    def read(self, key: str | bytes, z0: int = 0, z1: int | None = None, *, window: str | None = None,
             verify: bool = True) -> np.ndarray:
        """Slices ``z0 <= z < z1`` of a series as one ``(z1 - z0, rows, columns)`` array.

        HU int16 for CT (float32 where the rescale is not integral), or uint8 planes of a window stored
        at ingest (``window="lung"`` or ``"350/50"``). One LMDB cursor range scan; each value's checksum is verified
        unless ``verify=False``.
        """
        rec = self.record(key)
        depth = rec.shape[0]
        z1 = depth if z1 is None else z1
        if not 0 <= z0 < z1 <= depth:
            raise ConfigError(f"slices [{z0}, {z1}) are outside series {rec.key[:12]} of {depth} slices")
        name = None if window is None else windows.get(window).name  # "350/50" names its custom window
        if name is None:
            db_name, dtype = sh.SLICES, _NUMPY_DTYPES[rec.dtype]
        elif name in rec.windows:
            db_name, dtype = sh.window_db(name), np.uint8
        else:
            raise ConfigError(f"series {rec.key[:12]} has no stored {window!r} planes (it has {list(rec.windows) or 'none'})")
        out = np.empty((z1 - z0, rec.shape[1], rec.shape[2]), dtype=dtype)
        key_bytes = rec.key_bytes
        env = self._env(rec.shard)
        with env.begin(buffers=True) as txn:
            db = sh.open_dbs(env, [db_name], create=False, txn=txn)[db_name]
            cursor = txn.cursor(db=db)
            z = z0
            if cursor.set_key(slice_key(key_bytes, z0)):
                for k, v in cursor:
                    if z == z1:
                        break
                    if split_slice_key(bytes(k)) != (key_bytes, z):
                        break
                    if value_shape(v) != out.shape[1:]:
                        raise StoreError(f"slice {z} of series {rec.key[:12]} has shape {value_shape(v)}, record says {out.shape[1:]}")
                    decode_value(v, verify=verify, out=out[z - z0])
                    z += 1
        if z != z1:
            raise StoreError(f"series {rec.key[:12]} is missing slice {z} in shard {rec.shard}: the store is damaged; run `medload verify`")
        return out
