"""The shard one task of an ingest on Dask writes (:mod:`medload.ingest.dask_engine`).

A task writes the series of its batch into a staging shard of its own, under the run's directory in
``staging/``, each series in one write transaction, as :class:`~medload.storage.writer.StoreWriter`
does; it takes no lock and never touches ``store.json``. The coordinator, the store's one writer,
publishes the finished shard (:meth:`~medload.storage.writer.StoreWriter.adopt`). An attempt that dies
leaves an unfinished shard in the run's directory, which is never published and is removed at the end
of the run (or by the next ingest into the store). An ingest on this machine's cores
(:mod:`medload.ingest.local_engine`) uses the same shards, and publishes what a stopped task committed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import lmdb

from medload.storage import shard as sh
from medload.storage.manifest import file_digest
from medload.storage.records import LabelRecord, SeriesRecord
from medload.storage.series_transaction import SeriesTransaction

__all__ = ["TaskShardWriter", "committed_series", "shard_digest"]


class TaskShardWriter:
    """Write series into a new shard at ``path``; :meth:`close` syncs it and says whether it holds any."""

    def __init__(self, path: Path, windows: tuple[str, ...]) -> None:
        self.path = Path(path)
        self._windows = windows
        self._env: lmdb.Environment | None = None
        self._dbs: dict[bytes, sh.DbHandle] = {}
        self.committed: list[bytes] = []

    def begin_series(self, key: bytes, estimated_bytes: int) -> SeriesTransaction:
        """Start the one write transaction of series ``key``."""
        if self._env is None:
            self._env = sh.open_write_env(self.path, map_size=2 * estimated_bytes + (16 << 20))  # room for the sub-databases
            self._dbs = sh.open_dbs(self._env, sh.written_db_names(self._windows), create=True)
        sh.reserve(self._env, estimated_bytes)
        return SeriesTransaction(self, key, self._env.begin(write=True))

    def _committed(self, key: bytes, record: SeriesRecord | None, label: LabelRecord | None, replaces: bool) -> None:
        self.committed.append(key)

    def close(self) -> bool:
        """Sync and close the shard; remove it if no series was committed. Whether it holds any."""
        if self._env is not None:
            self._env.sync(True)
            self._env.close()
            self._env = None
        if not self.committed:
            shutil.rmtree(self.path, ignore_errors=True)
        return bool(self.committed)


def shard_digest(path: Path) -> str:
    """The xxh3-128 of a closed shard's ``data.mdb``, as ``store.json`` records it: computed by the task that
    wrote the shard, while its pages are still in the page cache, so the publishing process reads none of a
    shard's bytes (at 16 or 64 workers it would otherwise hash every byte of the ingest alone)."""
    return file_digest(Path(path) / "data.mdb")


def committed_series(path: Path) -> int:
    """How many series a task shard holds: for the shard of a task that was stopped, those it committed
    (each commit is synced) before it stopped."""
    if not (path / "data.mdb").exists():
        return 0
    env = sh.open_read_env(path)
    try:
        with env.begin() as txn:
            dbs = sh.open_dbs(env, [sh.SERIES], create=False, txn=txn)
            return txn.stat(dbs[sh.SERIES])["entries"] if sh.SERIES in dbs else 0
    finally:
        env.close()
