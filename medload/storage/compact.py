"""``medload compact``: rewrite the shards that hold superseded copies, so that ``ingest --force`` and
``medload repair`` do not grow a store forever.

A copy is superseded when a later shard marks its key replaced (see :mod:`medload.storage.live`); it is
never read again, but its bytes stay in its shard, which is immutable. Compaction copies the live
content of such a shard -- the series and labels that are live there, their values, planes and index
entries, every quarantine record, the replacement markers that still supersede something earlier --
byte for byte into a new shard, which takes the old one's place in the publish order (so the rule of
:mod:`~medload.storage.live` gives the same live copies), then removes the old shard. A shard with
nothing live left is dropped. Shards are rewritten one at a time in publish order, each with the steps
of :mod:`~medload.storage.compact_journal`: a kill at any moment leaves a store that verifies, and
the next writer tidies what it left.

Compaction holds ``writer.lock``, refuses a store that does not verify clean (``medload repair``
first), and needs free space for the largest rewritten shard. A reader that opened the store before
keeps reading the old files of a shard it had opened already; it should be reopened afterwards.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import lmdb

from medload.errors import StoreError
from medload.storage import shard as sh
from medload.storage.compact_journal import build_path, remove_journal, write_journal
from medload.storage.keys import SERIES_KEY_BYTES
from medload.storage.live import LiveRecords, merge, read_shard
from medload.storage.manifest import (
    Manifest,
    ShardEntry,
    file_digest,
    fsync_dir,
    read_manifest,
    shard_path,
    write_manifest,
)
from medload.storage.sharing import Sharing
from medload.storage.verify import verify_store
from medload.storage.writer import StoreWriter, _new_shard_name

__all__ = ["ShardCompaction", "CompactReport", "compact_store"]

log = logging.getLogger(__name__)

_TXN_BYTES = 64 << 20  # commit the copy every this many bytes, so one transaction never holds a whole shard
_MAP_HEADROOM = 1 << 30
_SLICE_KEYED = {sh.SLICES, sh.LABELS}
_INDEXES = set(sh.INDEXES.values())

#: whether compaction keeps an entry ``(key, value)`` of a sub-database
_Keep = Callable[[bytes, bytes], bool]


@dataclass(frozen=True)
class ShardCompaction:
    """One rewritten shard: its name, its replacement (None: nothing in it was live, it is gone), how
    many superseded series keys it held, and the bytes of its ``data.mdb`` before and after."""

    old: str
    new: str | None
    superseded: int
    bytes_before: int
    bytes_after: int


@dataclass
class CompactReport:
    """What :func:`compact_store` did: the shards rewritten, and the bytes of the ``data.mdb`` of every
    listed shard before and after."""

    store: str
    bytes_before: int
    bytes_after: int
    shards: list[ShardCompaction] = field(default_factory=list)


def compact_store(store: str | Path, *, progress: bool = False) -> CompactReport:
    """Rewrite the shards of the store at ``store`` that hold superseded copies (see the module docstring).

    Examples:
        >>> result = compact_store("stores/sample")    # nothing was ingested again with --force there
        >>> result.shards, result.bytes_after == result.bytes_before
        ([], True)
    """
    root = Path(store)
    manifest = read_manifest(root)
    with StoreWriter(root, codec=manifest.codec, windows=tuple(manifest.windows),
                     key_fingerprint=manifest.key_fingerprint) as writer:
        checked = verify_store(root, progress=progress)
        if not checked.ok:
            raise StoreError(f"{root} has {len(checked.damage)} damage finding(s), and compact rewrites only a store "
                             f"that verifies clean: see `medload verify {root}`, then `medload repair {root} "
                             "--sources DIR`")
        manifest = writer.manifest
        result = CompactReport(str(root), _bytes(manifest), 0)
        records = {e.name: read_shard(sh.reader_env(shard_path(root, e.name)), e.name) for e in manifest.shards}
        live = merge(records[e.name] for e in manifest.shards)
        held = {name: set(s.series) | set(s.labels) | {key for _, key in s.broken} for name, s in records.items()}
        for name in [e.name for e in manifest.shards if live.superseded.get(e.name)]:
            result.shards.append(_replace(root, manifest, name, live, held, writer.sharing))
        result.bytes_after = _bytes(manifest)
    return result


def _bytes(manifest: Manifest) -> int:
    return sum(e.bytes for e in manifest.shards)


def _replace(root: Path, manifest: Manifest, old: str, live: LiveRecords, held: dict[str, set[bytes]],
             sharing: Sharing) -> ShardCompaction:
    """Replace shard ``old`` by a copy of its live content (the steps of :mod:`compact_journal`), its files
    with the modes of the store's ``sharing``."""
    at = next(i for i, e in enumerate(manifest.shards) if e.name == old)
    entry, old_path = manifest.shards[at], shard_path(root, old)
    series = {k for k, r in live.series.items() if r.shard == old}
    labels = {k for k, r in live.labels.items() if r.shard == old}
    earlier = set().union(*(held[e.name] for e in manifest.shards[:at]))
    built = _new_shard_name()
    build = build_path(root, built)
    # None: the copy holds nothing live, so the shard is dropped, not replaced
    new = built if _copy(sh.reader_env(old_path), build, series, labels, earlier, entry.bytes) else None
    write_journal(root, old, new, sharing)
    log.debug("compact %s: journal written", old)
    if new is None:
        del manifest.shards[at]
    else:
        target = shard_path(root, new)
        sharing.apply(build)
        build.rename(target)
        fsync_dir(target.parent)
        log.debug("compact %s: %s moved into shards/", old, new)
        data = target / "data.mdb"
        manifest.shards[at] = ShardEntry(name=new, series=len(series), bytes=data.stat().st_size,
                                         digest=file_digest(data))
        held[new] = series | labels
    write_manifest(root, manifest)
    log.info("compact %s: store.json lists %s in its place", old, new or "nothing")
    sh.close_reader_envs([old_path])
    shutil.rmtree(old_path)
    fsync_dir(old_path.parent)
    log.info("compact %s: removed (%d bytes)", old, entry.bytes)
    remove_journal(root)
    return ShardCompaction(old, new, len(live.superseded[old]), entry.bytes, manifest.shards[at].bytes if new else 0)


def _copy(src: lmdb.Environment, build: Path, series: set[bytes], labels: set[bytes], earlier: set[bytes],
          src_bytes: int) -> bool:
    """Copy into a new shard at ``build`` what of ``src`` is live: values, records and index entries of
    ``series`` (and ``labels``, for label values and records), every quarantine record, the markers of
    keys an ``earlier`` shard holds. Returns False, leaving nothing, when there is nothing to copy."""
    with src.begin() as txn:
        names = [bytes(k) for k in txn.cursor().iternext(values=False)]
    wanted = {name: _filter(name, series, labels, earlier) for name in names}
    dst = sh.open_write_env(build, map_size=src_bytes + _MAP_HEADROOM)
    copied = 0
    try:
        for name in names:
            copied += _copy_db(src, dst, name, wanted[name])
            log.debug("compact: copied sub-database %s into %s", name.decode(), build.name)
        dst.sync(True)
    except Exception:
        dst.close()
        shutil.rmtree(build)
        raise
    dst.close()
    if not copied:
        shutil.rmtree(build)
        return False
    (build / "lock.mdb").unlink(missing_ok=True)
    log.info("compact: built %s (%d entries)", build.name, copied)
    return True


def _filter(name: bytes, series: set[bytes], labels: set[bytes], earlier: set[bytes]) -> _Keep:
    """Which ``(key, value)`` of sub-database ``name`` compaction keeps."""
    if name in _SLICE_KEYED or name.startswith(sh.window_db("")):
        keys = labels if name == sh.LABELS else series
        return lambda k, v: k[:SERIES_KEY_BYTES] in keys
    if name in (sh.SERIES, sh.LABEL_SERIES):
        keys = series if name == sh.SERIES else labels
        return lambda k, v: k in keys
    if name in _INDEXES:
        return lambda k, v: v in series
    if name == sh.REPLACED:
        return lambda k, v: k in earlier
    if name == sh.REJECTS:
        return lambda k, v: True
    raise StoreError(f"a shard holds sub-database {name!r}, which this medload does not know: compact it with the "
                     "medload release that wrote it")


def _copy_db(src: lmdb.Environment, dst: lmdb.Environment, name: bytes, keep: _Keep) -> int:
    """Copy the entries of sub-database ``name`` that ``keep`` accepts, in key order; returns how many."""
    dupsort = name in _INDEXES
    n = pending = 0
    with src.begin() as rtxn:
        src_db = src.open_db(name, txn=rtxn, create=False, dupsort=dupsort)
        dst_db = dst.open_db(name, create=True, dupsort=dupsort)
        wtxn = dst.begin(write=True)
        try:
            for k, v in rtxn.cursor(db=src_db):
                if not keep(k, v):
                    continue
                wtxn.put(k, v, db=dst_db, dupdata=dupsort, append=not dupsort)
                n, pending = n + 1, pending + len(v)
                if pending >= _TXN_BYTES:
                    wtxn.commit()
                    wtxn, pending = dst.begin(write=True), 0
            wtxn.commit()
        except BaseException:
            wtxn.abort()
            raise
    return n
