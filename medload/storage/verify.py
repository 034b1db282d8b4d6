"""``medload verify``: find and name damage in a store, read-only, never stopping at the first finding.

* manifest: ``store.json`` reads; every listed shard's ``data.mdb`` has the recorded size and xxh3-128,
  so a truncated or bit-flipped file is caught even where no value is touched;
* shards: LMDB opens each one (a file shorter than its own page count is not read at all: touching the
  missing pages would be SIGBUS); every series, label and reject record parses;
* values: each series has exactly ``shape[0]`` slices ``z = 0..D-1`` that decode with their checksum,
  shape and dtype, and whose digests give the record's ``digest``; window planes and labels likewise;
  values with no record are orphans; index entries point only to series of their shard, and every
  series is in every index its record has a value for;
* ``deep``: the per-slice xxh3_64 source hashes of each record are looked up among the files under
  ``sources`` (archives are not opened); a series with some sources found and others not has changed.

:attr:`VerifyReport.damage` is damage of committed data; ``notes`` hold what is not (shards a crashed
writer left unlisted or unpublished; series whose sources were not found).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import lmdb
import numpy as np
import xxhash

from medload.errors import ChecksumError, ConfigError, StoreError
from medload.progress import progress_bar
from medload.storage import shard as sh
from medload.storage.codec import decode_value
from medload.storage.digest import series_digest, slice_digest
from medload.storage.keys import SERIES_KEY_BYTES, split_slice_key
from medload.storage.manifest import Manifest, file_digest, manifest_path, read_manifest, shard_path
from medload.storage.records import LabelRecord, RejectRecord, SeriesRecord

__all__ = ["KINDS", "Damage", "VerifyReport", "verify_store"]

#: what a finding can be about
KINDS = ("manifest", "shard", "slice", "series", "index", "label", "orphan", "source")
_RESTORE = "restore the shard from a backup or re-ingest its series"


def _reingest(key: str) -> str:
    return f"re-ingest the series from its sources (`medload ingest --force {key[:12]}`)"


@dataclass(frozen=True)
class Damage:
    """One finding: its kind (see :data:`KINDS`), which thing (shard, series key, ``"KEY z=Z"``...),
    and one line saying what is wrong and what to do."""

    kind: str
    where: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind:8} {self.where}: {self.detail}"


@dataclass
class VerifyReport:
    """What :func:`verify_store` read and found; ``ok`` when it found no damage (notes do not count)."""

    store: str
    shards: int = 0
    series: int = 0
    slices: int = 0
    labels: int = 0
    damage: list[Damage] = field(default_factory=list)
    notes: list[Damage] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.damage

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}

    def add(self, kind: str, where: str, detail: str) -> None:
        self.damage.append(Damage(kind, where, detail))


@dataclass(frozen=True)
class _Expect:
    """What the values of one series in one sub-database must be."""

    shape: tuple[int, int, int]
    dtype: str
    digest: str | None
    kind: str  # kind of damage to a value: "slice" or "label"


def verify_store(path: str | Path, *, deep: bool = False, sources: Sequence[Path] = (),
                 progress: bool = False) -> VerifyReport:
    """Check the store at ``path`` without writing to it (see the module docstring for what is checked).

    ``deep`` also hashes every file under ``sources`` and matches the hashes with each series' sources.
    """
    started = time.perf_counter()
    root = Path(path)
    report = VerifyReport(str(root))
    if deep and not sources:
        raise ConfigError("a deep verify matches stored source hashes with files: give the source folders")
    try:
        manifest = read_manifest(root)
    except StoreError as exc:
        report.add("manifest", str(manifest_path(root)), str(exc))
        report.seconds = time.perf_counter() - started
        return report
    report.shards = len(manifest.shards)
    envs = _check_files(root, manifest, report)
    try:
        records, labels = _read_records(envs, report)
        with progress_bar("verify", len(records), enabled=progress) as advance:
            for name, env in envs.items():
                _check_shard(name, env, manifest, records, labels, report, advance)
        if deep:
            _check_sources(manifest, records, sources, report, progress)
    finally:
        for env in envs.values():
            env.close()
    report.seconds = time.perf_counter() - started
    return report


# ---- files -----------------------------------------------------------------------------------------
def _check_files(root: Path, manifest: Manifest, report: VerifyReport) -> dict[str, lmdb.Environment]:
    """Size and digest of each listed shard; notes for unlisted ones; returns the shards LMDB can read."""
    envs: dict[str, lmdb.Environment] = {}
    for entry in manifest.shards:
        data = shard_path(root, entry.name) / "data.mdb"
        if entry.name in envs:
            report.add("manifest", entry.name, "shard listed twice in store.json: remove one entry")
        elif not data.is_file():
            report.add("shard", entry.name, f"{data} is missing: {_RESTORE}")
        else:
            size = data.stat().st_size
            if size != entry.bytes:
                report.add("shard", entry.name, f"data.mdb has {size} bytes, store.json says {entry.bytes}: "
                                                f"truncated or replaced; {_RESTORE}")
            elif file_digest(data) != entry.digest:
                report.add("shard", entry.name, "data.mdb differs from its xxh3-128 in store.json (bit rot, or an "
                                                f"edit of a published shard); {_RESTORE}")
            if (env := _open(entry.name, data, size, report)) is not None:
                envs[entry.name] = env
    listed = {e.name for e in manifest.shards}
    for sub, why in (("shards", "published but not in store.json (a writer died before updating it): the next "
                                "`medload ingest` adds it"),
                     ("staging", "unpublished shard of an interrupted ingest: the next `medload ingest` publishes "
                                 "its committed series or discards it")):
        for p in sorted((root / sub).glob("*.lmdb")) if (root / sub).is_dir() else ():
            if sub == "staging" or p.name[: -len(".lmdb")] not in listed:
                report.notes.append(Damage("orphan", str(p.relative_to(root)), why))
    return envs


def _open(name: str, data: Path, size: int, report: VerifyReport) -> lmdb.Environment | None:
    env = None
    try:
        env = sh.open_read_env(data.parent)
        needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    except (lmdb.Error, StoreError) as exc:
        report.add("shard", name, f"LMDB cannot open it ({exc}): {_RESTORE}")
    else:
        if size >= needed:
            return env
        report.add("shard", name, f"data.mdb is truncated: {size} bytes, LMDB needs {needed}; not read: {_RESTORE}")
    if env is not None:
        env.close()
    return None


def _guard(report: VerifyReport, shard: str, what: str, fn: Callable[[], None]) -> None:
    """Run ``fn``; an LMDB error (a damaged B-tree) is damage of the shard, and the checks go on."""
    try:
        fn()
    except lmdb.Error as exc:
        report.add("shard", shard, f"LMDB error reading {what} ({exc}): the B-tree is damaged; {_RESTORE}")


# ---- records ---------------------------------------------------------------------------------------
def _read_records(envs: dict[str, lmdb.Environment], report: VerifyReport
                  ) -> tuple[dict[bytes, SeriesRecord], dict[bytes, LabelRecord]]:
    """Every parseable series and label record, with ``shard`` filled in; damage for the others."""
    records: dict[bytes, SeriesRecord] = {}
    labels: dict[bytes, LabelRecord] = {}

    def read(name: str, env: lmdb.Environment) -> None:
        with env.begin(buffers=True) as txn:
            dbs = sh.open_dbs(env, [sh.SERIES, sh.LABEL_SERIES, sh.REJECTS], create=False, txn=txn)
            if sh.SERIES not in dbs:
                report.add("shard", name, f"has no `series` sub-database; {_RESTORE}")
            for db, kind, parse, out in ((sh.SERIES, "series", SeriesRecord.from_json, records),
                                         (sh.LABEL_SERIES, "label", LabelRecord.from_json, labels)):
                for k, v in txn.cursor(db=dbs[db]) if db in dbs else ():
                    key = bytes(k)
                    try:
                        rec = parse(bytes(v))
                        _check_record(rec, key)
                    except (ValueError, TypeError) as exc:
                        report.add(kind, key.hex(), f"{kind} record in shard {name} does not parse ({exc}): "
                                                    + _reingest(key.hex()))
                        continue
                    if key in out:
                        report.add(kind, key.hex(), f"{kind} record in shards {out[key].shard} and {name}: "
                                                    "readers see only one; drop one shard from store.json")
                    out[key] = replace(rec, shard=name)
            for k, v in txn.cursor(db=dbs[sh.REJECTS]) if sh.REJECTS in dbs else ():
                try:
                    RejectRecord.from_json(bytes(v))
                except (ValueError, TypeError) as exc:
                    report.add("shard", f"{name} rejects {bytes(k).hex()}", f"reject record does not parse ({exc})")

    for name, env in envs.items():
        _guard(report, name, "records", lambda: read(name, env))  # noqa: B023 -- called at once
    report.series, report.labels = len(records), len(labels)
    return records, labels


def _check_record(rec: SeriesRecord | LabelRecord, key: bytes) -> None:
    if rec.key != key.hex():
        raise ValueError(f"it says key {rec.key}")
    np.dtype(rec.dtype)  # TypeError for an unknown dtype
    if isinstance(rec, SeriesRecord):
        if len(rec.shape) != 3 or min(rec.shape) < 1:
            raise ValueError(f"shape {rec.shape}")
        if len(rec.sources) != rec.shape[0]:
            raise ValueError(f"{len(rec.sources)} source hashes for {rec.shape[0]} slices")


# ---- values and indexes of one shard ---------------------------------------------------------------
def _check_shard(name: str, env: lmdb.Environment, manifest: Manifest, records: dict[bytes, SeriesRecord],
                 labels: dict[bytes, LabelRecord], report: VerifyReport, advance: Callable[[int], None]) -> None:
    mine = {k: r for k, r in records.items() if r.shard == name}
    entry = next(e for e in manifest.shards if e.name == name)
    if entry.series != len(mine):
        report.add("manifest", name, f"store.json counts {entry.series} series, the shard has {len(mine)} records")
    plans = [(sh.SLICES, {k: _Expect(r.shape, r.dtype, r.digest, "slice") for k, r in mine.items()})]
    for w in sorted({w for r in mine.values() for w in r.windows} | set(manifest.windows)):
        plans.append((sh.window_db(w), {k: _Expect(r.shape, "uint8", None, "slice")
                                        for k, r in mine.items() if w in r.windows}))
    label_expect = {}
    for k, lab in labels.items():
        if lab.shard == name and k not in records:
            report.add("label", k.hex(), f"label record in shard {name} has no series record: {_reingest(k.hex())}")
        elif lab.shard == name:
            label_expect[k] = _Expect(records[k].shape, lab.dtype, lab.digest, "label")
    plans.append((sh.LABELS, label_expect))

    def scan(db_name: bytes, expect: dict[bytes, _Expect]) -> None:
        with env.begin(buffers=True) as txn:
            dbs = sh.open_dbs(env, [db_name], create=False, txn=txn)
            if db_name in dbs:
                _scan(txn, dbs[db_name], db_name.decode(), name, expect, report,
                      advance if db_name == sh.SLICES else None)
            elif expect:
                report.add("shard", name, f"sub-database {db_name.decode()} is missing; {_RESTORE}")

    for db_name, expect in plans:
        _guard(report, name, db_name.decode(), lambda: scan(db_name, expect))  # noqa: B023 -- called at once
    _guard(report, name, "the indexes", lambda: _check_indexes(env, name, mine, report))


def _scan(txn: lmdb.Transaction, db, db_name: str, shard: str, expect: dict[bytes, _Expect], report: VerifyReport,
          advance: Callable[[int], None] | None) -> None:
    """One cursor pass over a sub-database keyed by slice keys, series by series."""
    group: _Group | None = None
    seen: set[bytes] = set()
    for k, v in txn.cursor(db=db):
        if len(k) != SERIES_KEY_BYTES + 4:
            report.add("orphan", bytes(k).hex(), f"key in {db_name} of shard {shard} is not a slice key")
            continue
        skey, z = split_slice_key(bytes(k))
        if group is None or group.key != skey:
            if group is not None:
                group.finish(report, advance)
            group = _Group(skey, expect.get(skey), db_name, shard)
            seen.add(skey)
        group.add(z, v, report)
    if group is not None:
        group.finish(report, advance)
    for skey in expect.keys() - seen:
        _Group(skey, expect[skey], db_name, shard).finish(report, advance)


class _Group:
    """The values of one series in one sub-database, checked as the cursor passes them."""

    def __init__(self, key: bytes, expect: _Expect | None, db_name: str, shard: str) -> None:
        self.key, self.expect, self.db_name, self.shard = key, expect, db_name, shard
        self.zs: list[int] = []
        self.digests: list[bytes] = []
        self.bad = 0

    def add(self, z: int, value, report: VerifyReport) -> None:
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
            report.add(e.kind, where, f"{why} (shard {self.shard}): {_reingest(self.key.hex())}")
            return
        report.slices += self.db_name == "slices"
        if e.digest is not None:
            self.digests.append(slice_digest(array))

    def finish(self, report: VerifyReport, advance: Callable[[int], None] | None) -> None:
        e, hexkey, where = self.expect, self.key.hex(), f"{self.db_name} of shard {self.shard}"
        if e is None:
            report.add("orphan", hexkey, f"{len(self.zs)} value(s) in {where} belong to no record: written outside "
                                         "a series transaction, which must never happen; re-ingest that series")
            return
        depth = e.shape[0]
        missing = sorted(set(range(depth)) - set(self.zs))
        extra = [z for z in self.zs if z >= depth]
        noun = "label slice" if e.kind == "label" else "slice"
        if missing:
            report.add(e.kind, hexkey, f"missing {noun}{'s' if len(missing) > 1 else ''} {_ranges(missing)} of "
                                       f"{depth} in {where}: {_reingest(hexkey)}")
        if extra:
            report.add(e.kind, hexkey, f"{noun}s {_ranges(extra)} beyond the record's {depth} in {where}")
        if e.digest is not None and not (missing or extra or self.bad):
            if series_digest(self.digests, e.shape, e.dtype) != e.digest:
                report.add("label" if e.kind == "label" else "series", hexkey,
                           f"content digest of the values in {where} differs from the record's: {_reingest(hexkey)}")
        if advance is not None:
            advance(1)


def _check_indexes(env: lmdb.Environment, shard: str, mine: dict[bytes, SeriesRecord], report: VerifyReport) -> None:
    """Index entries point to series of this shard with that value; every series is indexed."""
    with env.begin(buffers=True) as txn:
        dbs = sh.open_dbs(env, list(sh.INDEXES.values()), create=False, txn=txn)
        for field_name, db_name in sh.INDEXES.items():
            entries: set[tuple[str, bytes]] = set()
            for value, k in txn.cursor(db=dbs[db_name]) if db_name in dbs else ():
                value, k = bytes(value).decode(errors="replace"), bytes(k)
                entries.add((value, k))
                where = f"{shard} {db_name.decode()} {value!r}"
                if k not in mine:
                    report.add("index", where, f"points to series {k.hex()}, which has no record in this shard: "
                                               f"queries by {field_name} would return a series that does not exist")
                elif getattr(mine[k], field_name) != value:
                    report.add("index", where, f"lists series {k.hex()}, whose record says {field_name} "
                                               f"{getattr(mine[k], field_name)!r}")
            for k, rec in mine.items():
                value = getattr(rec, field_name)
                if value and (value, k) not in entries:
                    report.add("index", k.hex(), f"series is missing from {db_name.decode()} ({value!r}) of shard "
                                                 f"{shard}: queries by {field_name} miss it; {_reingest(k.hex())}")


def _ranges(zs: list[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``"1-3, 7"``."""
    out, start = [], None
    for i, z in enumerate(zs):
        start = z if start is None else start
        if i + 1 == len(zs) or zs[i + 1] != z + 1:
            out.append(str(start) if start == z else f"{start}-{z}")
            start = None
    return ", ".join(out)


# ---- deep: sources ---------------------------------------------------------------------------------
def _check_sources(manifest: Manifest, records: dict[bytes, SeriesRecord], sources: Sequence[Path],
                   report: VerifyReport, progress: bool) -> None:
    """Match each record's per-slice source hashes with the xxh3_64 of the files under ``sources``."""
    files = [p for s in map(Path, sources) for p in ([s] if s.is_file() else sorted(s.rglob("*"))) if p.is_file()]
    file_hash: dict[Path, str] = {}
    with progress_bar("hash sources", len(files), enabled=progress) as advance:
        for p in files:
            h = xxhash.xxh3_64()
            with open(p, "rb") as f:
                while block := f.read(8 << 20):
                    h.update(block)
            file_hash[p] = h.hexdigest()
            advance(1)
    hashes = set(file_hash.values())
    stored = {h for r in records.values() for h in r.sources}
    changed = _attribute(manifest, records, hashes, [p for p, h in file_hash.items() if h not in stored])
    for k, rec in records.items():
        missing = [z for z, h in enumerate(rec.sources) if h not in hashes]
        named = changed.get(rec.series, [])
        if missing and (len(missing) < rec.shape[0] or named):
            files_note = f"; changed files of its series: {', '.join(map(str, named[:5]))}" if named else ""
            report.add("source", k.hex(), f"{len(missing)} of {rec.shape[0]} source slices ({_ranges(missing)}) match "
                                          f"no file under the given folders: the sources changed after ingest"
                                          f"{files_note}; if the change is intended, {_reingest(k.hex())}")
        elif missing:
            report.notes.append(Damage("source", k.hex(), "no source file of this series is under the given folders "
                                                          "(or they are in archives, which are not opened)"))


def _attribute(manifest: Manifest, records: dict[bytes, SeriesRecord], hashes: set[str],
               unmatched: list[Path]) -> dict[str, list[Path]]:
    """Files matching no stored hash, by the pseudonym of their SeriesInstanceUID (0020,000E), for series
    whose hashes are not all found; needs the store's pseudonymisation key (else finds nothing)."""
    from medload.ingest.deid import Pseudonymizer, load_key

    wanted = {r.series for r in records.values() if any(h not in hashes for h in r.sources)}
    if not wanted or not unmatched:
        return {}
    try:
        pseudo = Pseudonymizer(load_key(create=False))
    except (ConfigError, OSError):
        return {}
    if pseudo.fingerprint != manifest.key_fingerprint:
        return {}
    import pydicom

    out: dict[str, list[Path]] = {}
    for p in unmatched:
        try:
            uid = pydicom.dcmread(p, stop_before_pixels=True, specific_tags=["SeriesInstanceUID"]).SeriesInstanceUID
        except Exception:  # noqa: BLE001 -- not DICOM, unreadable, or no UID: it cannot be attributed
            continue
        if (pseudonym := pseudo.uid("series", str(uid))) in wanted:
            out.setdefault(pseudonym, []).append(p)
    return out
