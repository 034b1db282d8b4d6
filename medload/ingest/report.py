"""What one ingest run did: per-series outcomes, quarantined inputs, and throughput."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from medload.storage.records import RejectRecord

__all__ = ["SeriesOutcome", "LabelOutcome", "IngestReport"]

STATUSES = ("ingested", "present", "skipped", "rejected", "conflict")


@dataclass(frozen=True)
class SeriesOutcome:
    """One candidate volume: ``ingested``, ``present`` (already in the store), ``skipped`` (not a
    volume), ``rejected`` (a policy or a broken file refused it) or ``conflict`` (its key is stored
    from different source instances; left unchanged)."""

    key: str
    status: str
    modality: str
    planes: int
    shape: tuple[int, int, int] | None = None
    reason: str | None = None


@dataclass(frozen=True)
class LabelOutcome:
    """One label input: ``ingested`` onto series ``key``, ``present`` (stored before), ``conflict``
    (the series has a different label) or ``rejected`` (with the reason)."""

    key: str | None
    source: str
    status: str
    kind: str
    classes: tuple[str, ...] = ()
    reason: str | None = None


@dataclass
class IngestReport:
    """Summary of :func:`medload.ingest.ingest`; ``exit_code`` is what the CLI returns."""

    store: str
    series: list[SeriesOutcome] = field(default_factory=list)
    rejects: list[RejectRecord] = field(default_factory=list)   # every quarantine record of this run
    labels: list[LabelOutcome] = field(default_factory=list)
    files: int = 0
    bytes: int = 0
    slices_written: int = 0
    seconds: float = 0.0

    def count(self, status: str) -> int:
        return sum(1 for s in self.series if s.status == status)

    @property
    def counts(self) -> dict[str, int]:
        c = Counter(s.status for s in self.series)
        return {status: c.get(status, 0) for status in STATUSES}

    def quarantined(self, status: str) -> list[RejectRecord]:
        """This run's quarantine records with ``status`` ``rejected`` or ``skipped``."""
        return [r for r in self.rejects if r.status == status]

    def exit_code(self, strict: bool) -> int:
        """0, or 1 under ``strict`` when anything was rejected or in conflict."""
        bad = self.count("conflict") + len(self.quarantined("rejected"))
        return 1 if strict and bad else 0

    @property
    def files_per_second(self) -> float:
        return self.files / self.seconds if self.seconds else 0.0

    @property
    def megabytes_per_second(self) -> float:
        return self.bytes / 1e6 / self.seconds if self.seconds else 0.0
