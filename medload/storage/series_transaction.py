"""One series' write transaction in a shard being written (rule 1 of :mod:`medload.storage.writer`): its
slices, pre-windowed planes, labels, record and index entries, visible only once committed. The store's
writer and a task's shard writer (:mod:`medload.storage.task_shard`) both write through it."""

from __future__ import annotations

from typing import Protocol

import lmdb

from medload.errors import StoreError
from medload.storage import shard as sh
from medload.storage.keys import slice_key
from medload.storage.records import LabelRecord, SeriesRecord

__all__ = ["SeriesTransaction"]


class _ShardOwner(Protocol):
    """What a :class:`SeriesTransaction` writes for: the open sub-databases of the shard being written,
    told of each commit (a :class:`StoreWriter`, or a Dask task's
    :class:`~medload.storage.task_shard.TaskShardWriter`)."""

    _dbs: dict[bytes, sh.DbHandle]

    def _committed(self, key: bytes, record: SeriesRecord | None, label: LabelRecord | None,
                   replaces: bool) -> None: ...


class SeriesTransaction:
    """Puts of one series (its slices, planes, labels, record, index entries) -- or of the labels of a
    series stored earlier -- into the current staging shard; nothing is visible until :meth:`commit`."""

    def __init__(self, writer: _ShardOwner, key: bytes, txn: lmdb.Transaction, *, replaces: bool = False) -> None:
        self._writer, self._key, self._replaces = writer, key, replaces
        self._txn: lmdb.Transaction | None = txn

    def _open_txn(self) -> lmdb.Transaction:
        """The write transaction, while it is neither committed nor aborted."""
        if self._txn is None:
            raise StoreError(f"the write transaction of series {self._key.hex()} was already committed or aborted: "
                             "begin a new one to write it")
        return self._txn

    def put_slice(self, z: int, value: bytes | memoryview, windows: dict[str, bytes | memoryview] | None = None) -> None:
        dbs, txn = self._writer._dbs, self._open_txn()
        k = slice_key(self._key, z)
        txn.put(k, value, db=dbs[sh.SLICES])
        for name, plane in (windows or {}).items():
            txn.put(k, plane, db=dbs[sh.window_db(name)])

    def put_label_slice(self, z: int, value: bytes) -> None:
        self._open_txn().put(slice_key(self._key, z), value, db=self._writer._dbs[sh.LABELS])

    def commit(self, record: SeriesRecord | None = None, index: dict[str, str | None] | None = None,
               label: LabelRecord | None = None) -> None:
        """Write the series record and index entries (and the replacement marker of a forced series)
        and/or the label record, and commit."""
        w, txn = self._writer, self._open_txn()
        if record is not None:
            txn.put(self._key, record.to_json(), db=w._dbs[sh.SERIES])
            if self._replaces:
                txn.put(self._key, b"", db=w._dbs[sh.REPLACED])
        for field_name, value in (index or {}).items():
            if value:
                txn.put(value.encode(), self._key, db=w._dbs[sh.INDEXES[field_name]], dupdata=True)
        if label is not None:
            txn.put(self._key, label.to_json(), db=w._dbs[sh.LABEL_SERIES])
        txn.commit()
        self._txn = None
        w._committed(self._key, record, label, self._replaces)

    def abort(self) -> None:
        if self._txn is not None:
            self._txn.abort()
            self._txn = None
