"""Errors raised by medload.

Every error derives from :class:`MedloadError`, and its message says what went wrong *and* what to do
about it. Problems with one input file or one series are not raised to the caller of ``ingest``: they
become quarantine records (see :class:`InputProblem`) so that one bad file never stops a run.
"""

from __future__ import annotations

__all__ = [
    "MedloadError",
    "ConfigError",
    "NoDicomError",
    "StoreError",
    "StoreFormatError",
    "StoreLockedError",
    "SeriesNotFoundError",
    "ChecksumError",
    "DiskFullError",
    "ManifestDamagedError",
    "StoreTooNewError",
    "ShardUnavailableError",
    "StorePermissionError",
    "InputProblem",
    "RemoteSourceError",
    "WorkerDiedError",
]


class MedloadError(Exception):
    """Base class of every error medload raises.

    Examples:
        >>> try:
        ...     medload.open_store("no/such/store")
        ... except medload.MedloadError as exc:
        ...     print(exc)   # what went wrong, and what to do
        no/such/store is not a medload store (no store.json): create it with `medload ingest`
    """


class ConfigError(MedloadError, ValueError):
    """An option or argument has a value medload cannot use."""


class NoDicomError(ConfigError):
    """The sources of an ingest hold no DICOM input (only files that are not DICOM, or none): nothing was
    written, and no store was created."""


class StoreError(MedloadError):
    """The store on disk cannot be opened, read or written as asked."""


class StoreFormatError(StoreError):
    """``store.json`` is missing, unreadable, or written by an incompatible format version."""


class StoreTooNewError(StoreFormatError):
    """The store was written by a newer medload, in a format version this one does not read: upgrade
    medload. The command line exits with its own status for it (3, see :mod:`medload.cli.failures`)."""


class StoreLockedError(StoreError):
    """Another process holds the store's writer lock."""


class SeriesNotFoundError(StoreError, KeyError):
    """No series in the store matches the key (or key prefix) asked for."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class ChecksumError(StoreError):
    """A stored value does not match its checksum: the store is damaged."""


class ManifestDamagedError(StoreFormatError):
    """``store.json`` is missing or does not parse, in a store directory (``medload repair`` restores it)."""


class StorePermissionError(StoreError):
    """A file of the store may not be read by this user: its owner shares it (``medload share``)."""


class ShardUnavailableError(StoreError):
    """A series lives in a shard that cannot be read (missing, truncated, damaged): ``medload repair``."""


class DiskFullError(StoreError):
    """A disk filled up (no space left, or a quota reached) while medload wrote to it.

    What was committed before stays intact, and running the same command again once there is space
    writes only what is missing (see :mod:`medload.storage.space`).

    Attributes:
        stage: what was being written: ``spool`` (archive members copied for reading, or instances
            retrieved from a PACS), ``commit`` (a series or quarantine records into the staging shard),
            ``publish`` (a shard into ``shards/`` and ``store.json``) or ``hot-shard copy``.
        path: where the write failed.
    """

    def __init__(self, message: str, stage: str, path: str) -> None:
        super().__init__(message)
        self.stage = stage
        self.path = path

    def __reduce__(self):  # picklable (it crosses from a Dask task to the coordinator)
        return type(self), (str(self), self.stage, self.path)


class InputProblem(MedloadError):
    """One input (a file, an archive member, or a series) cannot be ingested.

    Attributes:
        stage: where it was found: ``retrieve`` (DICOMweb), ``discover``, ``header``, ``series``, ``geometry``,
            ``decode`` or ``plausibility``.
        reason: one line saying what is wrong with the input.
        skipped: ``True`` when the input is valid DICOM that is simply not a volume (a localizer, a
            secondary capture, a structured report...), ``False`` when it is broken or rejected by policy.
    """

    def __init__(self, stage: str, reason: str, *, skipped: bool = False) -> None:
        super().__init__(f"{stage}: {reason}")
        self.stage = stage
        self.reason = reason
        self.skipped = skipped


class RemoteSourceError(MedloadError):
    """A remote source (a DICOMweb server) cannot be used at all: unreachable, untrusted certificate,
    credentials refused, or a failed search. One instance it cannot deliver is an :class:`InputProblem`."""


class WorkerDiedError(MedloadError):
    """A process of medload's own (an ingest's task process) died in the middle of its work: killed by a
    signal (the kernel's out-of-memory killer sends SIGKILL) or exited. The series its tasks and those that
    went down with it had committed are published; the others are reported failed, nothing of them stored,
    and running the ingest again stores them. What was stored before stays."""
