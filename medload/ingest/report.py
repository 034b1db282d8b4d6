"""What one ingest run did: per-series outcomes, quarantined inputs, and throughput."""

from __future__ import annotations

import builtins
from collections import Counter
from dataclasses import dataclass, field, replace

from medload.storage.records import RejectRecord

__all__ = ["SeriesOutcome", "LabelOutcome", "IngestReport"]

STATUSES = ("ingested", "replaced", "present", "skipped", "rejected", "conflict", "not_found", "failed", "unavailable")


@dataclass(frozen=True)
class SeriesOutcome:
    """One candidate volume: ``ingested``, ``replaced`` (forced: written again over the stored copy),
    ``present`` (already in the store), ``skipped`` (not a volume), ``rejected`` (a policy or a broken
    file refused it), ``conflict`` (its key is stored from different source instances; left unchanged)
    ``not_found`` (forced, but none of its files is among the sources; left unchanged), ``failed``
    (the task writing it failed before committing it: nothing of it was stored, running the ingest again
    retries it) or
    ``unavailable`` (stored in a shard that cannot be read: ``medload repair`` ingests it again)."""

    key: str
    status: str
    modality: str
    planes: int
    shape: tuple[int, int, int] | None = None
    reason: str | None = None


@dataclass(frozen=True)
class LabelOutcome:
    """One label input: ``ingested`` onto series ``key``, ``present`` (stored before), ``conflict``
    (the series has a different label), ``skipped`` (the series keeps another of its label objects,
    see :mod:`medload.ingest.label_writer`) or ``rejected`` (with the reason); or a stored label
    ``dropped`` with the copy of its series that a forced ingest replaced. ``source`` names the input
    without raw UIDs (:func:`~medload.ingest.labels.label_source_name`); ``kept``, for an ingested
    label, is the fraction of its foreground inside the series (below 1.0: the rest was cut off)."""

    key: str | None
    source: str
    status: str
    kind: str
    classes: tuple[str, ...] = ()
    reason: str | None = None
    kept: float | None = None


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

    def published_after_all(self, keys: builtins.set[str], why: str) -> None:
        """The ``failed`` series among ``keys`` (hex) were stored after all -- a task that failed had committed
        them, and its shard was published -- and become ``ingested``, with ``why`` as their reason."""
        for i, outcome in enumerate(self.series):
            if outcome.status == "failed" and outcome.key in keys:
                self.series[i] = replace(outcome, status="ingested", reason=why)
                self.slices_written += outcome.shape[0] if outcome.shape else outcome.planes

    def quarantined(self, status: str) -> list[RejectRecord]:
        """This run's quarantine records with ``status`` ``rejected``, ``skipped`` or ``ignored`` (not DICOM)."""
        return [r for r in self.rejects if r.status == status]

    def exit_code(self, strict: bool) -> int:
        """0; 1 when a forced series was not found among the sources, a series failed or is stored in a shard
        that cannot be read, or, under ``strict``, when anything was rejected or in conflict."""
        bad = self.count("conflict") + len(self.quarantined("rejected"))
        return 1 if self.count("not_found") or self.count("failed") or self.count("unavailable") or (strict and bad) else 0

    def mark_replaced(self, replaced: dict[builtins.bytes, bool]) -> None:  # the field `bytes` shadows the builtin here
        """Series written over a stored copy (key -> whether its stored labels were dropped, see
        :attr:`~medload.storage.writer.StoreWriter.replaced`) become ``replaced``; dropped labels are listed."""
        self.series = [replace(s, status="replaced") if s.status == "ingested" and bytes.fromhex(s.key) in replaced
                       else s for s in self.series]
        for key, dropped in sorted(replaced.items()):
            if dropped:
                self.labels.append(LabelOutcome(key.hex(), "stored label", "dropped", "", (), (
                    "replaced together with its series: ingest it again with --labels (or SEG/RTSTRUCT among the "
                    "sources)")))

    @property
    def files_per_second(self) -> float:
        return self.files / self.seconds if self.seconds else 0.0

    @property
    def megabytes_per_second(self) -> float:
        return self.bytes / 1e6 / self.seconds if self.seconds else 0.0
