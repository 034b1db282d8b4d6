"""``medload verify --deep``: do the source files of each series still exist, unchanged?

Each series record keeps the xxh3_64 of the file each slice came from (never its path: paths can hold
patient names). The files under the given folders are hashed and looked up; archives are not opened.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import xxhash

from medload.errors import ConfigError
from medload.progress import progress_bar
from medload.storage.manifest import Manifest
from medload.storage.records import SeriesRecord
from medload.storage.verify_report import Damage, VerifyReport, ranges, reingest_hint

__all__ = ["check_sources"]


def check_sources(manifest: Manifest, records: dict[bytes, SeriesRecord], sources: Sequence[Path],
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
            report.add("source", k.hex(), f"{len(missing)} of {rec.shape[0]} source slices ({ranges(missing)}) match "
                                          f"no file under the given folders: the sources changed after ingest"
                                          f"{files_note}; if the change is intended, {reingest_hint(k.hex())}",
                       series=k.hex())
        elif missing:
            report.notes.append(Damage("source", k.hex(), "no source file of this series is under the given folders "
                                                          "(or they are in archives, which are not opened)",
                                       series=k.hex()))


def _attribute(manifest: Manifest, records: dict[bytes, SeriesRecord], hashes: set[str],
               unmatched: list[Path]) -> dict[str, list[Path]]:
    """Files matching no stored hash, by the pseudonym of their SeriesInstanceUID (0020,000E), for series
    whose hashes are not all found; needs the store's pseudonymisation key (else finds nothing)."""
    from medload.deid import Pseudonymizer, load_key

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
