"""``medload repair``: ingest the damaged series of a store again from their sources, then verify again.

Every series that ``verify`` names as damaged is ingested again with ``force``: its new copy, written
into a new shard, supersedes the damaged one (see :mod:`medload.storage.live`). A store keeps only the
hashes of its source files, never their paths (a path can hold a patient's name), so the sources are
given. A shard whose bytes changed after it was published, but whose live values all verify once the
damaged ones are superseded, is *resealed*: ``store.json`` records its present bytes.

A shard readers cannot use at all (missing, truncated, not LMDB, a damaged B-tree, swapped files) is
*retired* once every series whose live copy it held is stored again: moved to ``STORE/retired/`` with
a note saying why, never deleted. Its series are known from the keys ``store.json`` lists for it
(format 3); where it lists none (a format-2 manifest), every series of the sources that the store
lacks is ingested. A damaged ``store.json`` is first restored from its copy ``store.json.bak``, and a
format-2 manifest upgraded; like every writer, repair first adds to ``store.json`` the published shards it
misses (:meth:`~medload.storage.writer.StoreWriter._recover`: a crash, or an older copy put back).

Labels go with the damaged copy of a series. Those given (``labels``, or SEG/RTSTRUCT among the sources)
are stored with the series ingested again; those not given are *lost* (``verify`` notes each series whose
earlier copy had labels and whose live copy has none), and a later repair given them stores them again,
with or without sources. What this cannot repair -- values that belong to no record, a series whose
files are not among the sources, labels that were not given again -- is reported.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from medload.config import IngestConfig
from medload.deid import KeyFile
from medload.errors import ConfigError
from medload.ingest.report import LabelOutcome, SeriesOutcome
from medload.ingest.run import ingest
from medload.storage.availability import read_shards
from medload.storage.live import merge
from medload.storage.manifest import FORMAT_VERSION, Manifest, read_manifest, restore_manifest, shard_path
from medload.storage.shard import close_reader_envs
from medload.storage.verify import VerifyReport, verify_store
from medload.storage.writer import StoreWriter

log = logging.getLogger(__name__)

__all__ = ["RepairReport", "repair_store"]


@dataclass
class RepairReport:
    """What :func:`repair_store` found and did: verify reports before and after, what ingesting each
    damaged series again gave (``replaced`` when repaired), the label maps stored again (label outcomes),
    the series whose stored labels went with their damaged copy and were not given again, the shards
    resealed, the shards retired (name -> its note) and those left in place (name -> why), whether
    ``store.json`` was restored or upgraded, and the published shards it missed that were added to it."""

    before: VerifyReport
    after: VerifyReport
    series: list[SeriesOutcome] = field(default_factory=list)
    labels: list[LabelOutcome] = field(default_factory=list)
    labels_dropped: list[str] = field(default_factory=list)
    resealed: list[str] = field(default_factory=list)
    retired: dict[str, Path] = field(default_factory=dict)
    not_retired: dict[str, str] = field(default_factory=dict)
    restored: bool = False
    upgraded: bool = False
    adopted: list[str] = field(default_factory=list)

    @property
    def needed(self) -> bool:
        """Whether the store needed more than restoring, upgrading or adopting: damage, or lost labels."""
        return not self.before.ok or bool(self.before.labels_lost)

    @property
    def ok(self) -> bool:
        """The store verifies clean and lost no labels."""
        return self.after.ok and not self.labels_dropped


def repair_store(store: str | Path, sources: Sequence[str | Path] = (), *, labels: Sequence[str | Path] = (),
                 config: IngestConfig | None = None, key_file: str | Path | KeyFile | None = None,
                 progress: bool = False) -> RepairReport:
    """Repair the store at ``store`` from the DICOM under ``sources`` (see the module docstring);
    ``labels`` are given to the ingest (for series whose labels are not among the sources).

    Examples:
        >>> result = repair_store("stores/ct", ["/archive/ct"])   # doctest: +SKIP
        >>> result.ok, [s.status for s in result.series]   # doctest: +SKIP
        (True, ['replaced'])
    """
    root = Path(store)
    restored = restore_manifest(root)
    manifest = read_manifest(root)
    upgraded = manifest.version != FORMAT_VERSION or any(e.keys is None for e in manifest.shards)
    with _writer(root, manifest) as writer:  # adds the shards store.json misses, lists each shard's keys
        adopted = writer.adopted
    upgraded = upgraded and read_manifest(root).version == FORMAT_VERSION
    before = verify_store(root, progress=progress)
    result = RepairReport(before, before, restored=restored, upgraded=upgraded, adopted=adopted)
    if not result.needed:
        return result
    manifest = read_manifest(root)
    keys = sorted({d.series for d in before.damage if d.series})
    unlisted = [e.name for e in manifest.shards if e.name in before.unreadable and e.keys is None]
    if (keys or unlisted) and not sources:
        raise ConfigError(f"{len(keys) or 'the'} damaged series must be ingested again from their sources, and a "
                          "store keeps only hashes of its sources, never their paths: give the folders, files or "
                          "archives that hold them with --sources")
    if keys or unlisted or (before.labels_lost and (sources or labels)):
        if unlisted:
            log.warning("store.json does not list the series of shard(s) %s: ingesting every series of the sources "
                        "that the store lacks", ", ".join(unlisted))
        cfg = replace(config or IngestConfig(), codec=manifest.codec, windows=tuple(manifest.windows))
        close_reader_envs([shard_path(root, e.name) for e in manifest.shards])  # none open when ingest forks workers
        report = ingest(list(sources), root, config=cfg, key_file=key_file, progress=progress, labels=labels,
                        force=keys, force_only=not unlisted)
        result.series = [s for s in report.series if s.key in keys or unlisted and s.status == "ingested"]
        result.labels = [o for o in report.labels if o.status == "ingested"]
    _retire(root, before, result)
    after = verify_store(root, progress=progress)
    if after.resealable:
        with _writer(root, read_manifest(root)) as writer:
            writer.reseal(after.resealable)
        result.resealed = after.resealable
        after = verify_store(root, progress=progress)
    result.after = after
    result.labels_dropped = after.labels_lost
    return result


def _writer(root: Path, manifest: Manifest) -> StoreWriter:
    return StoreWriter(root, codec=manifest.codec, windows=tuple(manifest.windows),
                       key_fingerprint=manifest.key_fingerprint)


def _retire(root: Path, before: VerifyReport, result: RepairReport) -> None:
    """Retire each unreadable shard that holds no live copy any more (its series were stored again)."""
    if not before.unreadable:
        return
    manifest = read_manifest(root)
    down = {name: next(d.detail for d in before.damage if d.unreadable and d.shard == name)
            for name in before.unreadable}
    listed = {e.name for e in manifest.shards}
    live = merge(read_shards(root, manifest, down)[0])
    held: dict[str, list[str]] = {}
    for (kind, key), shard in live.unavailable.items():
        if kind == "series":
            held.setdefault(shard, []).append(key.hex())
    with _writer(root, manifest) as writer:
        for name, why in down.items():
            if name not in listed:
                continue
            if held.get(name):
                result.not_retired[name] = (f"{len(held[name])} of its series are not stored again (not among the "
                                            f"sources?), e.g. {held[name][0][:12]}")
                continue
            result.retired[name] = writer.retire(name, why)
