"""``medload verify``: find and name damage in a store, read-only, never stopping at the first finding.

Checks: ``store.json`` reads and each listed ``data.mdb`` has its recorded size and xxh3-128; LMDB opens
each shard (one shorter than its own page count is not read: that would be SIGBUS); each shard holds the
records ``store.json`` lists for it (format 3); every record parses;
each live series has exactly ``shape[0]`` slices ``z = 0..D-1`` that decode with their checksum, shape
and dtype, and whose digests give the record's ``digest``; window planes and labels likewise; values
with no record are orphans; indexes point only to series of their shard and list every series; a key
held by two shards is damage unless the later one marks it replaced (see :mod:`medload.storage.live`):
the superseded copy is not checked, only noted with the bytes it takes. ``deep``: each record's
per-slice source hashes are looked up among the files under ``sources``. ``damage`` is damage of
committed data; ``notes`` hold the rest (shards a crashed writer left unlisted or unpublished,
superseded copies, series whose sources were not found, shards ``repair`` retired, series whose labels
were lost with an earlier copy (:attr:`VerifyReport.labels_lost`), labels that were cut by their series'
extent when ingested). A shard readers
cannot use at all is *unreadable* (:attr:`VerifyReport.unreadable`), and each series whose live copy
it holds is damage: ``repair`` ingests those again and retires the shard.

The checks live in :mod:`~medload.storage.verify_shard` (one shard), :mod:`~medload.storage.verify_isolated`
(suspect shards, read in a child process) and :mod:`~medload.storage.verify_sources` (``deep``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

from medload.errors import ConfigError, ShardUnavailableError, StoreError, StoreFormatError, StoreTooNewError
from medload.progress import progress_bar
from medload.storage import shard as sh
from medload.storage.availability import check_keys
from medload.storage.live import LiveRecords, ShardRecords, lost_shard, merge
from medload.storage.manifest import Manifest, backup_path, file_digest, manifest_path, read_manifest, shard_path
from medload.storage.records import SeriesRecord, percent
from medload.storage.verify_isolated import run_check
from medload.storage.verify_report import KINDS, RESTORE, Damage, VerifyReport, reingest_hint
from medload.storage.verify_shard import Expect, shard_records, shard_values
from medload.storage.verify_sources import check_sources

__all__ = ["KINDS", "Damage", "VerifyReport", "verify_store"]


def verify_store(path: str | Path, *, deep: bool = False, sources: Sequence[Path] = (),
                 progress: bool = False) -> VerifyReport:
    """Check the store at ``path`` without writing to it; ``deep`` also matches the source hashes of
    each series with the files under ``sources`` (see the module docstring)."""
    started = time.perf_counter()
    root = Path(path)
    report = VerifyReport(str(root))
    if deep and not sources:
        raise ConfigError("a deep verify matches stored source hashes with files: give the source folders")
    if not any(p.exists() for p in (manifest_path(root), backup_path(root), root / "shards")):
        raise StoreFormatError(f"{root} is not a medload store (no store.json, no store.json.bak, no shards/): "
                               "give the folder `medload ingest` wrote")
    try:
        manifest = read_manifest(root)
    except StoreTooNewError:
        raise  # not damage: this medload cannot read it (upgrade medload)
    except StoreError as exc:
        report.add("manifest", str(manifest_path(root)), str(exc))
        report.seconds = time.perf_counter() - started
        return report
    report.shards = len(manifest.shards)
    readable, suspect = _check_files(root, manifest, report)
    shards = _read_records(root, manifest, readable, suspect, report)
    live = merge(shards)
    _check_records(live, report)
    _note_cut_labels(live, report)
    report.series, report.labels = len(live.series), len(live.labels)
    with progress_bar("verify", len(live.series), enabled=progress) as advance:
        for s in shards:
            if s.name in report.unreadable:
                continue
            mine, plans = _plans(s, manifest, live, report)
            isolated = s.name in suspect
            named = {key for _, key in s.broken} | {key for _, key, earlier, _ in live.duplicates if earlier == s.name}
            reclaimable = run_check(report, isolated, s.name, shard_values, root, s.name, plans, mine, named,
                                    live.superseded.get(s.name, set()), None if isolated else advance)
            if isolated:
                advance(len(mine))
            for key, n in sorted((reclaimable or {}).items()):
                why = f"superseded copy in shard {s.name}, {n} bytes reclaimable (a later shard replaced it)"
                report.notes.append(Damage("series", key.hex(), why, shard=s.name))
    _name_lost_series(live, report)
    _note_lost_labels(root, shards, live, report)
    if deep:
        check_sources(manifest, live.series, sources, report, progress)
    report.seconds = time.perf_counter() - started
    return report


def _read_records(root: Path, manifest: Manifest, readable: list[str], suspect: set[str],
                  report: VerifyReport) -> list[ShardRecords]:
    """The records of each listed shard, in manifest order; an unreadable shard, or one holding other records
    than store.json lists, takes part by its listed keys (so its series are not taken from older copies)."""
    got: dict[str, ShardRecords] = {}
    for name in readable:
        found = run_check(report, name in suspect, name, shard_records, root, name)
        if found is None or name in report.unreadable:
            continue
        entry = next(e for e in manifest.shards if e.name == name)
        try:
            check_keys(entry, found)
        except ShardUnavailableError as exc:
            report.add_unreadable(name, f"{exc}; {RESTORE}")
            continue
        got[name] = found
    listed = {e.name: e for e in manifest.shards}.values()
    return [got.get(e.name) or lost_shard(e.name, e.keys) for e in listed]


def _name_lost_series(live: LiveRecords, report: VerifyReport) -> None:
    """Damage for each series (and label) whose live copy is in an unreadable shard, unless named already."""
    unreadable = set(report.unreadable)
    lost = dict(live.unavailable)
    lost.update({("series", k): r.shard for k, r in live.series.items() if r.shard in unreadable})
    lost.update({("label", k): r.shard for k, r in live.labels.items() if r.shard in unreadable})
    named = {(d.kind, d.series) for d in report.damage}
    for (kind, key), shard in sorted(lost.items()):
        stored = key in live.series or ("series", key) in lost
        if (kind, key.hex()) not in named:
            report.add(kind, key.hex(), f"its live {kind} copy is in shard {shard}, which cannot be read: "
                                        f"{reingest_hint(key.hex())}", series=key.hex() if stored else None, shard=shard)


def _note_lost_labels(root: Path, shards: list[ShardRecords], live: LiveRecords, report: VerifyReport) -> None:
    """A note for each live series without labels whose earlier copy had them: a later copy superseded them
    (``ingest --force`` or ``repair`` without them), or their shard was retired (its note lists them)."""
    had: dict[bytes, str] = {}  # series key -> where its lost labels were
    for s in shards:
        held = {*s.labels, *(k for kind, k in [*s.broken, *s.lost] if kind == "label")}
        had.update((k, f"shard {s.name}") for k in sorted(held & live.superseded.get(s.name, set())))
    for note in sorted((root / "retired").glob("*.json")) if (root / "retired").is_dir() else ():
        try:
            listed = json.loads(note.read_text())["store_json_entry"]["keys"]["labels"]
            had.update((bytes.fromhex(k), f"retired shard {note.stem}") for k in listed)
        except (OSError, ValueError, KeyError, TypeError):  # no keys listed (format 2) or a damaged note
            continue
    labelled = {*live.labels, *(k for kind, k in [*live.broken, *live.unavailable] if kind == "label")}
    for key in sorted(k for k in had if k in live.series and k not in labelled):
        report.labels_lost.append(key.hex())
        report.notes.append(Damage("label", key.hex(), f"labels lost: an earlier copy of this series had labels (in "
                                   f"{had[key]}), the live copy has none: give them again with `medload repair "
                                   f"{root} --labels PATH` (SEG/RTSTRUCT: with --sources DIR)", series=key.hex()))


# ---- files -----------------------------------------------------------------------------------------
def _check_files(root: Path, manifest: Manifest, report: VerifyReport) -> tuple[list[str], set[str]]:
    """Size and digest of each listed shard; notes for unlisted ones. Returns the shards LMDB can open and
    those of them whose bytes differ from store.json."""
    readable: list[str] = []
    suspect: set[str] = set()
    seen: set[str] = set()
    for entry in manifest.shards:
        name, data = entry.name, shard_path(root, entry.name) / "data.mdb"
        if name in seen:
            report.add("manifest", name, "shard listed twice in store.json: remove one entry", shard=name)
            continue
        seen.add(name)
        if not data.is_file():
            report.add_unreadable(name, f"{data} is missing: {RESTORE}")
        else:
            size = data.stat().st_size
            if size != entry.bytes:
                report.add_unreadable(name, f"data.mdb has {size} bytes, store.json says {entry.bytes}: truncated or "
                                            f"replaced (readers do not open it); {RESTORE}")
                suspect.add(name)
            elif file_digest(data) != entry.digest:
                report.add("shard", name, "data.mdb differs from its xxh3-128 in store.json (bit rot, or an "
                                          f"edit of a published shard); {RESTORE}", shard=name)
                report.changed.append(name)
                suspect.add(name)
            if _opens(name, data, report) and name not in report.unreadable:
                readable.append(name)
    for sub, why in (("shards", "published but not in store.json (a writer died before updating it, or an older "
                                "store.json was put back): its series are not read; `medload repair` (or the next "
                                "`ingest` or `compact`) adds it"),
                     ("staging", "unpublished shard of an interrupted ingest: the next `medload ingest` publishes "
                                 "its committed series or discards it")):
        for p in sorted((root / sub).glob("*.lmdb")) if (root / sub).is_dir() else ():
            if sub == "staging" or p.name[: -len(".lmdb")] not in seen:
                report.notes.append(Damage("orphan", str(p.relative_to(root)), why))
    for note in sorted((root / "retired").glob("*.json")) if (root / "retired").is_dir() else ():
        report.notes.append(Damage("shard", str(note.relative_to(root)), "a shard `medload repair` took out of the "
                                   "store (the note says why); kept, never read: delete it when no longer wanted"))
    return readable, suspect


def _opens(name: str, data: Path, report: VerifyReport) -> bool:
    """Whether LMDB opens the shard and its file holds every page its meta page counts (only the meta
    pages are read: this is safe on any file). The handle is this process's one (see
    :func:`~medload.storage.shard.reader_env`): LMDB refuses a second one, e.g. next to an open Store."""
    try:
        sh.reader_env(data.parent)
    except ShardUnavailableError as exc:
        report.add_unreadable(name, f"{exc}; not read: {RESTORE}")
        return False
    return True


# ---- records ---------------------------------------------------------------------------------------
def _check_records(live: LiveRecords, report: VerifyReport) -> None:
    """Keys held twice with no replacement marker; live records that do not parse."""
    for kind, key, earlier, later in live.duplicates:
        report.add(kind, key.hex(), f"{kind} record in shards {earlier} and {later}, and {later} does not mark it "
                                    f"replaced: readers take the later one; {reingest_hint(key.hex())}",
                   series=key.hex() if _stored(live, key) else None, shard=later)
    for (kind, key), (name, why) in live.broken.items():
        report.add(kind, key.hex(), f"{kind} record in shard {name} does not parse ({why}): {reingest_hint(key.hex())}",
                   series=key.hex() if _stored(live, key) else None, shard=name)


def _note_cut_labels(live: LiveRecords, report: VerifyReport) -> None:
    """A note (not damage: the store holds what was ingested) for each label that lay partly outside its
    series when it was ingested (``LabelRecord.kept`` below 1)."""
    for key, label in sorted(live.labels.items()):
        if label.kept is not None and label.kept < 1:
            report.notes.append(Damage("label", key.hex(), f"label {label.source} keeps {percent(label.kept)} of its "
                                       "foreground: the rest lay outside the series and was cut off when it was "
                                       f"ingested; check it (`medload view STORE {key.hex()[:12]} --label`)",
                                       shard=label.shard))


def _stored(live: LiveRecords, key: bytes) -> bool:
    """Whether series ``key`` has a live record (that parses or not): ``ingest --force`` can replace it."""
    return key in live.series or ("series", key) in live.broken


def _plans(s: ShardRecords, manifest: Manifest, live: LiveRecords, report: VerifyReport
           ) -> tuple[dict[bytes, SeriesRecord], list[tuple[bytes, dict[bytes, Expect]]]]:
    """The live series records of shard ``s``, and what each of its slice-keyed sub-databases must hold."""
    name = s.name
    mine = {k: r for k, r in live.series.items() if r.shard == name}
    entry = next(e for e in manifest.shards if e.name == name)
    held = len(s.series) + sum(kind == "series" for kind, _ in s.broken)
    if entry.series != held:
        report.add("manifest", name, f"store.json counts {entry.series} series, the shard has {held} records",
                   shard=name)
    plans = [(sh.SLICES, {k: Expect(r.shape, r.dtype, r.digest, "slice") for k, r in mine.items()})]
    for w in sorted({w for r in mine.values() for w in r.windows} | set(manifest.windows)):
        plans.append((sh.window_db(w), {k: Expect(r.shape, "uint8", None, "slice")
                                        for k, r in mine.items() if w in r.windows}))
    label_expect = {}
    for k, lab in live.labels.items():
        if lab.shard != name:
            continue
        if k in live.series:
            label_expect[k] = Expect(live.series[k].shape, lab.dtype, lab.digest, "label")
        elif not _stored(live, k):
            report.add("label", k.hex(), f"label record in shard {name} has no series record: ingest its series "
                                         "again (`medload ingest DIR STORE`)", shard=name)
    return mine, [*plans, (sh.LABELS, label_expect)]
