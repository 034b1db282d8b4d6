"""The checks of one shard for ``medload verify``: its records, every value of its slice-keyed
sub-databases (checksum, shape, dtype, key continuity, series digest), and its indexes.

Each check writes its findings into a :class:`~medload.storage.verify_report.VerifyReport` and goes
on: an LMDB error (a damaged B-tree) is damage of the shard, never the end of the run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lmdb
import numpy as np

from medload.errors import ChecksumError, StoreError
from medload.storage import shard as sh
from medload.storage.codec import decode_value
from medload.storage.digest import series_digest, slice_digest
from medload.storage.keys import SERIES_KEY_BYTES, split_slice_key
from medload.storage.live import ShardRecords, read_shard
from medload.storage.manifest import shard_path
from medload.storage.records import LabelRecord, SeriesRecord
from medload.storage.verify_report import RESTORE, VerifyReport, ranges, reingest_hint

__all__ = ["Expect", "shard_records", "shard_values"]


@dataclass(frozen=True)
class Expect:
    """What the values of one series in one sub-database must be."""

    shape: tuple[int, int, int]
    dtype: str
    digest: str | None
    kind: str  # kind of damage to a value: "slice" or "label"


def _guard(report: VerifyReport, shard: str, what: str, fn: Callable[[], None]) -> None:
    """Run ``fn``; an LMDB error (a damaged B-tree) is damage of the shard, and the checks go on."""
    try:
        fn()
    except lmdb.Error as exc:
        report.add_unreadable(shard, f"LMDB error reading {what} ({exc}): the B-tree is damaged; {RESTORE}")


# ---- records ---------------------------------------------------------------------------------------
def shard_records(report: VerifyReport, root: Path, name: str) -> ShardRecords:
    """The records and replacement markers of a shard; records that do not parse or do not fit their key
    are listed as broken (named as damage later, unless a later shard replaced them)."""
    env = sh.reader_env(shard_path(root, name))
    out = ShardRecords(name)

    def read() -> None:
        nonlocal out
        with env.begin() as txn:
            if sh.SERIES not in sh.open_dbs(env, [sh.SERIES], create=False, txn=txn):
                report.add_unreadable(name, f"has no `series` sub-database; {RESTORE}")
        out = read_shard(env, name, check=_check_record)

    _guard(report, name, "records", read)
    return out


def _check_record(rec: SeriesRecord | LabelRecord, key: bytes) -> None:
    if rec.key != key.hex():
        raise ValueError(f"it says key {rec.key}")
    np.dtype(rec.dtype)  # TypeError for an unknown dtype
    if isinstance(rec, SeriesRecord):
        if len(rec.shape) != 3 or min(rec.shape) < 1:
            raise ValueError(f"shape {rec.shape}")
        if len(rec.sources) != rec.shape[0]:
            raise ValueError(f"{len(rec.sources)} source hashes for {rec.shape[0]} slices")


# ---- values and indexes ----------------------------------------------------------------------------
def shard_values(report: VerifyReport, root: Path, name: str, plans: list[tuple[bytes, dict[bytes, Expect]]],
                 mine: dict[bytes, SeriesRecord], skip: set[bytes], superseded: set[bytes],
                 advance: Callable[[int], None] | None) -> dict[bytes, int]:
    """Check every value of the slice-keyed sub-databases of a shard, and its indexes. ``mine``: its live
    series records; values of ``skip`` keys (damage named already: records that do not parse, copies held
    twice) are not checked, those of ``superseded`` copies are only counted: returns their bytes per key."""
    env = sh.reader_env(shard_path(root, name))
    reclaimable: dict[bytes, int] = {}

    def scan(db_name: bytes, expect: dict[bytes, Expect]) -> None:
        with env.begin(buffers=True) as txn:
            dbs = sh.open_dbs(env, [db_name], create=False, txn=txn)
            if db_name in dbs:
                pass_ = _Pass(db_name.decode(), name, expect, skip, superseded, reclaimable, report,
                              advance if db_name == sh.SLICES else None)
                pass_.run(txn.cursor(db=dbs[db_name]))
            elif expect:
                report.add_unreadable(name, f"sub-database {db_name.decode()} is missing; {RESTORE}")

    for db_name, expect in plans:
        _guard(report, name, db_name.decode(), lambda: scan(db_name, expect))  # noqa: B023 -- called at once
    _guard(report, name, "the indexes", lambda: _check_indexes(env, name, mine, skip | superseded, report))
    return reclaimable


class _Pass:
    """One cursor pass over a sub-database keyed by slice keys, series by series."""

    def __init__(self, db_name: str, shard: str, expect: dict[bytes, Expect], skip: set[bytes],
                 superseded: set[bytes], reclaimable: dict[bytes, int], report: VerifyReport,
                 advance: Callable[[int], None] | None) -> None:
        self.db_name, self.shard, self.expect, self.skip = db_name, shard, expect, skip
        self.superseded, self.reclaimable, self.report, self.advance = superseded, reclaimable, report, advance

    def run(self, cursor: lmdb.Cursor) -> None:
        group: _Group | None = None
        seen: set[bytes] = set()
        for k, v in cursor:
            if len(k) != SERIES_KEY_BYTES + 4:
                self.report.add("orphan", bytes(k).hex(), f"key in {self.db_name} of shard {self.shard} is not a "
                                                          "slice key", shard=self.shard)
                continue
            skey, z = split_slice_key(bytes(k))
            if skey in self.superseded:
                self.reclaimable[skey] = self.reclaimable.get(skey, 0) + len(v)
                continue
            if group is None or group.key != skey:
                if group is not None:
                    group.finish(self.report, self.advance)
                group = _Group(skey, self.expect.get(skey), self.db_name, self.shard, skey in self.skip)
                seen.add(skey)
            group.add(z, v, self.report)
        if group is not None:
            group.finish(self.report, self.advance)
        for skey in self.expect.keys() - seen:
            _Group(skey, self.expect[skey], self.db_name, self.shard, False).finish(self.report, self.advance)


class _Group:
    """The values of one series in one sub-database, checked as the cursor passes them."""

    def __init__(self, key: bytes, expect: Expect | None, db_name: str, shard: str, named: bool) -> None:
        self.key, self.expect, self.db_name, self.shard, self.named = key, expect, db_name, shard, named
        self.zs: list[int] = []
        self.digests: list[bytes] = []
        self.bad = 0

    def add(self, z: int, value: bytes | memoryview, report: VerifyReport) -> None:
        self.zs.append(z)
        e = self.expect
        if e is None or z >= e.shape[0]:
            return
        where = f"{self.key.hex()} z={z}" + ("" if self.db_name == "slices" else f" {self.db_name}")
        try:
            array = decode_value(value)
            if array.shape != tuple(e.shape[1:]) or array.dtype != np.dtype(e.dtype):
                raise StoreError(f"value is {array.shape} {array.dtype}, the record says {e.shape[1:]} {e.dtype}")
        except (StoreError, ValueError, RuntimeError) as exc:
            self.bad += 1
            why = "value fails its xxh3_64 checksum" if isinstance(exc, ChecksumError) else str(exc)
            report.add(e.kind, where, f"{why} (shard {self.shard}): {reingest_hint(self.key.hex())}",
                       series=self.key.hex(), shard=self.shard)
            return
        report.slices += self.db_name == "slices"
        if e.digest is not None:
            self.digests.append(slice_digest(array))

    def finish(self, report: VerifyReport, advance: Callable[[int], None] | None) -> None:
        e, hexkey, where = self.expect, self.key.hex(), f"{self.db_name} of shard {self.shard}"
        if e is None and self.named:  # its record does not parse, or is held twice: named already
            return
        if e is None:
            report.add("orphan", hexkey, f"{len(self.zs)} value(s) in {where} belong to no record: written outside "
                                         "a series transaction, which must never happen; re-ingest that series",
                       shard=self.shard)
            return
        depth = e.shape[0]
        missing = sorted(set(range(depth)) - set(self.zs))
        extra = [z for z in self.zs if z >= depth]
        noun = "label slice" if e.kind == "label" else "slice"
        attribution = {"series": hexkey, "shard": self.shard}
        if missing:
            report.add(e.kind, hexkey, f"missing {noun}{'s' if len(missing) > 1 else ''} {ranges(missing)} of "
                                       f"{depth} in {where}: {reingest_hint(hexkey)}", **attribution)
        if extra:
            report.add(e.kind, hexkey, f"{noun}s {ranges(extra)} beyond the record's {depth} in {where}", **attribution)
        if e.digest is not None and not (missing or extra or self.bad) and \
                series_digest(self.digests, e.shape, e.dtype) != e.digest:
            report.add("label" if e.kind == "label" else "series", hexkey, f"content digest of the values in "
                       f"{where} differs from the record's: {reingest_hint(hexkey)}", **attribution)
        if advance is not None:
            advance(1)


def _check_indexes(env: lmdb.Environment, shard: str, mine: dict[bytes, SeriesRecord], skip: set[bytes],
                   report: VerifyReport) -> None:
    """Index entries point to live series of this shard with that value (entries of ``skip`` keys, whose
    records are named already or superseded, are not checked); every live series is indexed."""
    with env.begin(buffers=True) as txn:
        dbs = sh.open_dbs(env, list(sh.INDEXES.values()), create=False, txn=txn)
        for field_name, db_name in sh.INDEXES.items():
            entries: set[tuple[str, bytes]] = set()
            for raw_value, raw_key in txn.cursor(db=dbs[db_name]) if db_name in dbs else ():
                value, k = bytes(raw_value).decode(errors="replace"), bytes(raw_key)
                entries.add((value, k))
                where = f"{shard} {db_name.decode()} {value!r}"
                if k in skip:
                    continue
                if k not in mine:
                    report.add("index", where, f"points to series {k.hex() or '(empty key)'}, which has no record in "
                                               f"this shard: queries by {field_name} would return a series that does "
                                               "not exist", shard=shard)
                elif getattr(mine[k], field_name) != value:
                    report.add("index", where, f"lists series {k.hex()}, whose record says {field_name} "
                                               f"{getattr(mine[k], field_name)!r}", series=k.hex(), shard=shard)
            for k, rec in mine.items():
                value = getattr(rec, field_name)
                if value and (value, k) not in entries:
                    report.add("index", k.hex(), f"series is missing from {db_name.decode()} ({value!r}) of shard "
                                                 f"{shard}: queries by {field_name} miss it; {reingest_hint(k.hex())}",
                               series=k.hex(), shard=shard)
