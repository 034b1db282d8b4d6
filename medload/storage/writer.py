"""The one writer of a store: one LMDB write transaction per series, shards published atomically.

Crash safety comes from five rules:

1. A series -- its slices, pre-windowed planes, metadata record and index entries -- is written in
   one write transaction of the current *staging* shard, so it is either fully present or absent.
2. A staging shard is synced to disk, then published by ``rename(staging/X.lmdb, shards/X.lmdb)``
   followed by an atomic rewrite of ``store.json``. Readers only open shards the manifest lists;
   published shards are durable and immutable.
3. A writer that starts after a crash (it holds ``writer.lock``, so the previous writer is gone)
   publishes whatever committed series the dead writer left in ``staging/`` and adds any renamed
   shard the manifest missed. Nothing committed is ever lost or re-written.
4. Every commit is synced to disk (``sync=True``): a series committed is durable, whatever happens
   to the process or the machine. (Skipping the per-commit fsync and trusting staging shards only
   within one boot gained too little to be worth the extra rule: docs/benchmarks.md, "Design measurements".)
5. A series is written once, unless it is *forced* (:meth:`StoreWriter.force`, ``ingest --force``):
   the new copy goes into the staging shard with a ``replaced`` marker in the same transaction, and
   supersedes the earlier copy and its labels once published (see :mod:`medload.storage.live`).

A shard that cannot be read does not stop a writer (see :mod:`medload.storage.availability`): its
listed series count as stored (:attr:`StoreWriter.unavailable`), so only a forced ingest writes them
again, and :meth:`StoreWriter.retire` moves it to ``retired/`` once they are (``medload repair``). A
writer lists the keys of every shard it reads in ``store.json`` (format 3).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import shutil
import socket
import time
from collections.abc import Iterable
from dataclasses import asdict, replace
from pathlib import Path

import lmdb

from medload.deid import check_key_fingerprint
from medload.errors import ConfigError, StoreError, StoreLockedError
from medload.storage import rejects
from medload.storage import shard as sh
from medload.storage.availability import read_shards
from medload.storage.compact_journal import finish_interrupted
from medload.storage.keys import match_key
from medload.storage.live import ShardRecords, merge, read_shard
from medload.storage.manifest import (
    FORMAT_VERSION,
    Manifest,
    ShardEntry,
    backup_path,
    check_store_folder,
    file_digest,
    fsync_dir,
    manifest_path,
    read_manifest,
    retired_path,
    shard_path,
    staging_path,
    write_file_atomic,
    write_manifest,
)
from medload.storage.records import LabelRecord, RejectRecord, SeriesRecord
from medload.storage.series_transaction import SeriesTransaction
from medload.storage.sharing import PRIVATE, reconciled_setting, sharing_of
from medload.storage.space import disk_full_is_error
from medload.version import __version__

__all__ = ["StoreWriter", "SeriesTransaction"]

log = logging.getLogger(__name__)

_MAP_HEADROOM = 1 << 30


class StoreWriter:
    """Create or open a store for writing. Holds ``writer.lock`` until :meth:`close`.

    Args:
        root: store directory (created with mode 0700 if missing).
        codec, windows: used when the store is created; an existing store keeps its own, and asking
            for different ones is an error (the store's values must stay uniform).
        key_fingerprint: fingerprint of the pseudonymisation key; a store refuses a different key,
            since the same patient would otherwise get two pseudonyms.
        shard_bytes: a staging shard is published and a new one started once it exceeds this size.
        share: who may read the store (``private``, ``group``, ``group:NAME``; see
            :mod:`medload.storage.sharing`), recorded in ``store.json``; None: keep the store's (a new store:
            ``private``). Every file and folder of the store gets its modes when the writer opens it, and every
            file the writer creates, as it is published.
    """

    def __init__(self, root: Path, *, codec: str, windows: tuple[str, ...], key_fingerprint: str,
                 shard_bytes: int = 4 << 30, share: str | None = None) -> None:
        self.root = Path(root)
        self.shard_bytes = shard_bytes
        check_store_folder(self.root)
        self._lock_fd: int | None = self._acquire_lock()
        #: shards published but missing from store.json that this writer added to it (see :meth:`_recover`)
        self.adopted: list[str] = []
        try:
            self.manifest = self._open_or_create(codec, windows, key_fingerprint, share)
            self.sharing = sharing_of(self.root, self.manifest.share or PRIVATE)
            self.sharing.apply(self.root)
            self._recover()
            self.series_fingerprints: dict[bytes, str] = {}
            self.label_fingerprints: dict[bytes, str] = {}
            self.reject_keys: set[bytes] = set()
            self._rejected: dict[bytes, RejectRecord] = {}  # the current quarantine records (storage.rejects)
            #: series whose live copy is in a shard that cannot be read -> that shard
            self.unavailable: dict[bytes, str] = {}
            self._load_known()
            self._forced: set[bytes] = set()
            #: series replaced by this writer -> whether they lost stored labels (not written again yet)
            self.replaced: dict[bytes, bool] = {}
        except BaseException:
            self._release_lock()
            raise
        self._env: lmdb.Environment | None = None
        self._dbs: dict[bytes, sh.DbHandle] = {}
        self._staging_name = ""

    # ---- lifecycle -------------------------------------------------------------------------
    def _acquire_lock(self) -> int:
        """flock ``writer.lock`` (released by the kernel when this process dies, however it dies) and
        write our pid and host into it, so a refused writer can say who holds the store."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.root / "writer.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StoreLockedError(
                f"another medload process ({holder}) is writing to {self.root} (writer.lock is held): "
                "wait for it to finish; readers are not blocked"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        return fd

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _open_or_create(self, codec: str, windows: tuple[str, ...], key_fingerprint: str,
                        share: str | None) -> Manifest:
        for sub in ("shards", "staging"):
            (self.root / sub).mkdir(mode=0o700, exist_ok=True)
        if not manifest_path(self.root).exists() and not backup_path(self.root).exists():
            manifest = Manifest(codec=codec, windows=tuple(windows), key_fingerprint=key_fingerprint,
                                created_by=f"medload {__version__}", share=share or PRIVATE)
            write_manifest(self.root, manifest)
            log.info("created store %s (codec %s, windows %s)", self.root, codec, ",".join(windows) or "none")
            return manifest
        manifest = read_manifest(self.root)
        check_key_fingerprint(self.root, manifest.key_fingerprint, key_fingerprint)
        if manifest.codec != codec or tuple(manifest.windows) != tuple(windows):
            raise ConfigError(
                f"{self.root} stores codec {manifest.codec} and windows {list(manifest.windows)}; this run asks "
                f"for codec {codec} and windows {list(windows)}: keep the store's settings or ingest into a new store"
            )
        kept = share or reconciled_setting(manifest.share, manifest_path(self.root))
        if kept != manifest.share:
            log.info("store %s: share setting %s -> %s", self.root, manifest.share, kept)
            manifest.share = kept
            write_manifest(self.root, manifest)
        return manifest

    def _recover(self) -> None:
        """Publish what a crashed writer left: committed series in staging, shards the manifest missed
        (after tidying what a killed ``medload compact`` left, whose copies must not be published). Every
        writer does this first -- ``ingest``, ``compact`` and ``repair`` -- so a ``store.json`` that lags
        behind ``shards/`` (a crash, or an older copy put back) lists every published shard again."""
        finish_interrupted(self.root, self.manifest)
        listed = {s.name for s in self.manifest.shards}
        for path in sorted((self.root / "shards").glob("*.lmdb")):
            name = path.name[: -len(".lmdb")]
            if name not in listed:
                log.warning("shard %s is in shards/ but not in store.json (a writer stopped between the two: killed, "
                            "or its disk was full); listing it", name)
                try:
                    self._add_to_manifest(name, path)
                    self.adopted.append(name)
                except (StoreError, lmdb.Error) as exc:
                    log.warning("shard %s cannot be read (%s): left out of store.json; `medload verify` notes it",
                                name, exc)
        for path in sorted((self.root / "staging").glob("*.lmdb")):
            name = path.name[: -len(".lmdb")]
            env = sh.open_write_env(path, map_size=_MAP_HEADROOM)
            try:
                n = _count(env, sh.SERIES, sh.LABEL_SERIES, sh.REJECTS)
                env.sync(True)
            finally:
                env.close()
            if n == 0:
                shutil.rmtree(path)
                continue
            log.warning("publishing %d committed records left in staging shard %s by an interrupted ingest", n, name)
            self._publish_path(name, path)

    def _load_known(self) -> None:
        """Fingerprints of the live series and labels (a record that does not parse, or that is in a shard
        that cannot be read, counts as present, with an empty fingerprint: only a forced ingest replaces
        it), and the keys of the quarantine records. Lists the keys of shards that store.json lacks."""
        shards, down = read_shards(self.root, self.manifest)
        live = merge(shards)
        self.series_fingerprints.update({k: r.source_fingerprint for k, r in live.series.items()})
        self.label_fingerprints.update({k: r.source_fingerprint for k, r in live.labels.items()})
        for kind, key in [*live.broken, *live.unavailable]:
            (self.series_fingerprints if kind == "series" else self.label_fingerprints)[key] = ""
        self.unavailable = {key: shard for (kind, key), shard in live.unavailable.items() if kind == "series"}
        self._list_keys(shards, down)
        held: list[list[RejectRecord]] = []
        for entry in self.manifest.shards:
            if entry.name in down:
                continue
            env = sh.reader_env(shard_path(self.root, entry.name), entry.bytes)
            with env.begin() as txn:
                dbs = sh.open_dbs(env, [sh.REJECTS], create=False, txn=txn)
                if sh.REJECTS in dbs:
                    held.append([RejectRecord.from_json(v) for v in txn.cursor(db=dbs[sh.REJECTS]).iternext(keys=False)])
        self._rejected = {r.record_key: r for r in rejects.current(held)}
        self.reject_keys = set(self._rejected)

    def _list_keys(self, shards: list, down: dict[str, str]) -> None:
        """Upgrade store.json to format 3: the keys of each shard it does not list them for and that reads."""
        keys = {s.name: s.keys() for s in shards if s.name not in down}
        entries = [e if e.keys is not None or e.name not in keys else replace(e, keys=keys[e.name])
                   for e in self.manifest.shards]
        if entries != self.manifest.shards or self.manifest.version != FORMAT_VERSION:
            log.info("store.json of %s: format %d -> %d (the keys each shard holds)", self.root, self.manifest.version,
                     FORMAT_VERSION)
            self.manifest.shards = entries
            write_manifest(self.root, self.manifest)

    def close(self) -> None:
        """Publish the current staging shard (if it holds anything: else remove it) and release the lock."""
        try:
            if self._env is not None and _count(self._env, sh.SERIES, sh.LABEL_SERIES, sh.REJECTS) == 0:
                self._env.close()  # e.g. the one series begun did not fit on the disk
                self._env, self._dbs = None, {}
                shutil.rmtree(staging_path(self.root, self._staging_name))
            elif self._env is not None:
                self._publish_current()
        finally:
            self._release_lock()

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- writing ---------------------------------------------------------------------------
    def force(self, keys: Iterable[str]) -> list[bytes]:
        """Let :meth:`begin_series` write these stored series again (full hex keys or unique prefixes of
        at least 8 digits), each once; returns their keys. An unknown or ambiguous key is an error."""
        found = [match_key(k, self.series_fingerprints, self.root, min_digits=8) for k in keys]
        self._forced.update(found)
        return found

    def begin_series(self, key: bytes, estimated_bytes: int) -> SeriesTransaction:
        """Start the one write transaction of series ``key``; reserve map space for it first. A forced
        series (see :meth:`force`) is written again: its commit marks the stored copy replaced."""
        replaces = key in self._forced
        if key in self.series_fingerprints and not replaces:
            raise StoreError(f"series {key.hex()} is already in {self.root}; it is written again only when forced "
                             f"(`medload ingest SRC {self.root} --force {key.hex()[:12]}`)")
        return self._begin(estimated_bytes, key, replaces)

    def begin_labels(self, key: bytes, estimated_bytes: int) -> SeriesTransaction:
        """Start the write transaction of the labels of series ``key``, stored earlier."""
        if key not in self.series_fingerprints or key in self.label_fingerprints:
            raise StoreError(f"series {key.hex()} is not in {self.root} or already has labels")
        return self._begin(estimated_bytes, key)

    def _begin(self, estimated_bytes: int, key: bytes, replaces: bool = False) -> SeriesTransaction:
        env = self._staging_env()
        sh.reserve(env, estimated_bytes)
        return SeriesTransaction(self, key, env.begin(write=True), replaces=replaces)

    def put_rejects(self, records: Iterable[RejectRecord]) -> int:
        """Record quarantined inputs not already recorded; returns how many were new."""
        new = [r for r in records if r.record_key not in self.reject_keys]
        self._put_records(new)
        self._rejected.update((r.record_key, r) for r in new)
        self.reject_keys.update(r.record_key for r in new)
        return len(new)

    def resolve_rejects(self, sources: Iterable[str], series: Iterable[str]) -> int:
        """Supersede the current quarantine records of ``sources`` (paths this run stored) and the series-level
        ones of ``series`` (hex keys of series it wrote), see :mod:`medload.storage.rejects`; returns how many."""
        paths, keys = set(sources), set(series)
        done = {k: r for k, r in self._rejected.items()
                if r.source in paths or (r.series in keys and r.stage != "labels")}
        self._put_records(list({r.source: rejects.resolution(r) for r in done.values()}.values()))
        for k in done:
            del self._rejected[k]
            self.reject_keys.discard(k)
        return len(done)

    def _put_records(self, records: list[RejectRecord]) -> None:
        """Quarantine records into the staging shard, in one transaction."""
        if not records:
            return
        env = self._staging_env()
        with env.begin(write=True) as txn:
            for r in records:
                txn.put(r.record_key, r.to_json(), db=self._dbs[sh.REJECTS])

    def _staging_env(self) -> lmdb.Environment:
        if self._env is None:
            self._staging_name = _new_shard_name()
            path = staging_path(self.root, self._staging_name)
            self._env = sh.open_write_env(path, map_size=self.shard_bytes + _MAP_HEADROOM)
            self._dbs = sh.open_dbs(self._env, sh.written_db_names(self.manifest.windows), create=True)
        return self._env

    def _committed(self, key: bytes, record: SeriesRecord | None, label: LabelRecord | None, replaces: bool) -> None:
        if record is not None:
            self.series_fingerprints[key] = record.source_fingerprint
        if replaces:
            self._forced.discard(key)
            self.replaced[key] = self.label_fingerprints.pop(key, None) is not None
        if label is not None:
            self.label_fingerprints[key] = label.source_fingerprint
            if key in self.replaced:
                self.replaced[key] = False
        if self._env is not None and sh.env_bytes(self._env) >= self.shard_bytes:  # the commit's staging shard
            self._publish_current()

    # ---- publishing ------------------------------------------------------------------------
    def _publish_current(self) -> None:
        env, name = self._env, self._staging_name
        if env is None:  # no staging shard open: nothing to publish
            return
        self._env, self._dbs = None, {}
        env.sync(True)
        env.close()
        self._publish_path(name, staging_path(self.root, name))

    def _publish_path(self, name: str, path: Path, digest: str | None = None, found: ShardRecords | None = None) -> None:
        with disk_full_is_error(self.root, "publish", f"publishing shard {name}"):
            (path / "lock.mdb").unlink(missing_ok=True)
            self.sharing.apply(path)
            target = shard_path(self.root, name)
            os.replace(path, target)
            fsync_dir(target.parent)
            self._add_to_manifest(name, target, digest, found)
        log.info("published shard %s", name)

    def adopt(self, path: Path, digest: str | None = None) -> dict[bytes, SeriesRecord]:
        """Publish a shard that another process wrote, synced and closed (a task of an ingest on Dask or on
        this machine's cores, see :mod:`medload.ingest.shard_tasks`), under a new name; return its series
        records. ``digest``: the xxh3-128 of its ``data.mdb`` as the task that closed it computed it
        (:func:`~medload.storage.task_shard.shard_digest`), so this process -- the one every shard passes
        through -- does not read the shard's bytes again; None: computed here.

        A shard holding a series the store already has is refused (StoreError) and left where it is:
        publishing it would store that series twice, so a task that ran twice is published once.
        """
        name = _new_shard_name()
        env = sh.open_read_env(path)
        try:
            found = read_shard(env, name)
        finally:
            env.close()
        twice = sorted(k.hex()[:12] for k in found.series if k in self.series_fingerprints)
        if twice or found.broken:
            raise StoreError(f"shard {path} holds series already in {self.root} ({', '.join(twice)}) or records that "
                             f"do not parse: not published")
        self._publish_path(name, path, digest, found)
        for key, record in found.series.items():
            self.series_fingerprints[key] = record.source_fingerprint
        return found.series

    def reseal(self, names: Iterable[str]) -> None:
        """Record the present size and xxh3-128 of these published shards in ``store.json``: for shards whose
        bytes changed after publishing although every live value in them verifies (``medload repair``)."""
        wanted = set(names)
        shards = []
        for entry in self.manifest.shards:
            if entry.name in wanted:
                data = shard_path(self.root, entry.name) / "data.mdb"
                entry = replace(entry, bytes=data.stat().st_size, digest=file_digest(data))
                log.info("shard %s: store.json now records its changed bytes (%s)", entry.name, entry.digest)
            shards.append(entry)
        self.manifest.shards = shards
        write_manifest(self.root, self.manifest)

    def retire(self, name: str, reason: str) -> Path:
        """Take shard ``name``, which cannot be read and whose series are stored again in other shards, out
        of the store, deleting nothing: a note saying why goes to ``retired/<name>.json``, what is left of
        the shard to ``retired/<name>.lmdb``, then ``store.json`` drops it. Returns the note.

        A crash in between leaves the shard listed and missing: the next repair retires it again, keeping
        the first note."""
        entry = next(e for e in self.manifest.shards if e.name == name)
        source, target = shard_path(self.root, name), retired_path(self.root, name)
        target.parent.mkdir(mode=0o700, exist_ok=True)
        self.sharing.apply(target.parent)
        note = target.with_suffix(".json")
        if not target.exists() or not note.exists():
            doc = {"shard": name, "retired": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   "by": f"medload {__version__} repair", "reason": reason, "store_json_entry": asdict(entry),
                   "series": "stored again in other shards" if entry.keys else "not listed in store.json (format 2): "
                             "every series of the sources that the store lacked was ingested",
                   "files": "what was left of it is next to this note" if source.exists() else "none were left"}
            write_file_atomic(note, (json.dumps(doc, indent=1) + "\n").encode(), self.sharing)
        if source.exists():
            sh.close_reader_envs([source])
            os.replace(source, target)
            self.sharing.apply(target)
            fsync_dir(target.parent)
            fsync_dir(source.parent)
        self.manifest.shards = [e for e in self.manifest.shards if e.name != name]
        write_manifest(self.root, self.manifest)
        log.warning("retired shard %s of %s to %s (see %s)", name, self.root, target, note)
        return note

    def _add_to_manifest(self, name: str, path: Path, digest: str | None = None,
                         found: ShardRecords | None = None) -> None:
        """List shard ``name`` in ``store.json``; ``digest`` and ``found`` (its records): computed here unless given."""
        keys = (found or read_shard(sh.reader_env(path), name)).keys()
        data = path / "data.mdb"
        self.manifest.shards.append(ShardEntry(name=name, series=len(keys.series), bytes=data.stat().st_size,
                                               digest=digest or file_digest(data), keys=keys))
        write_manifest(self.root, self.manifest)


def _new_shard_name() -> str:
    """A shard name that sorts by creation time and is unique across writers and machines."""
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + "-" + secrets.token_hex(4)


def _count(env: lmdb.Environment, *names: bytes) -> int:
    """Entries in these sub-databases together."""
    with env.begin() as txn:
        dbs = sh.open_dbs(env, list(names), create=False, txn=txn)
        return sum(txn.stat(db)["entries"] for db in dbs.values())
