"""``medload repair``: ingest the damaged series of a store again from their sources, then verify again.

Every series that ``verify`` names as damaged is ingested again with ``force``: its new copy, written
into a new shard, supersedes the damaged one (see :mod:`medload.storage.live`). A store keeps only the
hashes of its source files, never their paths (a path can hold a patient's name), so the sources are
given. A shard whose bytes changed after it was published, but whose live values all verify once the
damaged ones are superseded, is *resealed*: ``store.json`` records its present bytes. What this cannot
repair -- a shard LMDB cannot read, values that belong to no record, a series whose files are not
among the sources, labels that were not given again -- is reported.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from medload.config import IngestConfig
from medload.errors import ConfigError
from medload.ingest.report import SeriesOutcome
from medload.ingest.run import ingest
from medload.storage.manifest import read_manifest, shard_path
from medload.storage.shard import close_reader_envs
from medload.storage.verify import VerifyReport, verify_store
from medload.storage.writer import StoreWriter

__all__ = ["RepairReport", "repair_store"]


@dataclass
class RepairReport:
    """What :func:`repair_store` found and did: verify reports before and after, what ingesting each
    damaged series again gave (``replaced`` when repaired), the series whose stored labels went with
    their damaged copy and were not given again, and the shards resealed."""

    before: VerifyReport
    after: VerifyReport
    series: list[SeriesOutcome] = field(default_factory=list)
    labels_dropped: list[str] = field(default_factory=list)
    resealed: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """The store verifies clean and lost no labels."""
        return self.after.ok and not self.labels_dropped


def repair_store(store: str | Path, sources: Sequence[str | Path] = (), *, labels: Sequence[str | Path] = (),
                 config: IngestConfig | None = None, key_file: str | Path | None = None,
                 progress: bool = False) -> RepairReport:
    """Repair the store at ``store`` from the DICOM under ``sources`` (see the module docstring);
    ``labels`` are given to the ingest (for series whose labels are not among the sources).

    Examples:
        >>> result = repair_store("stores/ct", ["/archive/ct"])   # doctest: +SKIP
        >>> result.ok, [s.status for s in result.series]   # doctest: +SKIP
        (True, ['replaced'])
    """
    root = Path(store)
    before = verify_store(root, progress=progress)
    result = RepairReport(before, before)
    if before.ok:
        return result
    keys = sorted({d.series for d in before.damage if d.series})
    if keys:
        if not sources:
            raise ConfigError(f"{len(keys)} damaged series must be ingested again from their sources, and a store "
                              "keeps only hashes of its sources, never their paths: give the folders, files or "
                              "archives that hold them with --sources")
        manifest = read_manifest(root)
        cfg = replace(config or IngestConfig(), codec=manifest.codec, windows=tuple(manifest.windows))
        close_reader_envs([shard_path(root, e.name) for e in manifest.shards])  # none open when ingest forks workers
        report = ingest(list(sources), root, config=cfg, key_file=key_file, progress=progress, labels=labels,
                        force=keys, force_only=True)
        result.series = [s for s in report.series if s.key in keys]
        result.labels_dropped = [o.key for o in report.labels if o.status == "dropped"]
    after = verify_store(root, progress=progress)
    if after.resealable:
        manifest = read_manifest(root)
        with StoreWriter(root, codec=manifest.codec, windows=tuple(manifest.windows),
                         key_fingerprint=manifest.key_fingerprint) as writer:
            writer.reseal(after.resealable)
        result.resealed = after.resealable
        after = verify_store(root, progress=progress)
    result.after = after
    return result
