"""Which quarantine records are current: a source rejected by one ingest and stored by a later one is not.

A rejected file is often fixed (its permissions, a truncated copy fetched again) and ingested by a later
run. Published shards never change, so that run cannot remove the record: its writer records a
``resolved`` record for each source with a current record that it stored -- a file of a series it
wrote, a label it stored, or a series-level record of a series it wrote -- and a record is current
unless a later shard holds a ``resolved`` record of its source (the same path, as the record names it).
``resolved`` records are not themselves listed, and a source rejected again after that is recorded again.
"""

from __future__ import annotations

from collections.abc import Iterable

from medload.storage.records import RejectRecord

__all__ = ["RESOLVED", "current", "resolution"]

#: status of the record that supersedes the earlier records of its source
RESOLVED = "resolved"


def current(shards: Iterable[Iterable[RejectRecord]]) -> list[RejectRecord]:
    """The current records among the quarantine records of ``shards``, given in publish order."""
    held: dict[str, list[RejectRecord]] = {}  # source -> its current records
    for records in map(list, shards):
        for r in records:
            if r.status == RESOLVED:
                held.pop(r.source, None)
        for r in records:
            if r.status != RESOLVED:
                held.setdefault(r.source, []).append(r)
    return [r for records in held.values() for r in records]


def resolution(record: RejectRecord) -> RejectRecord:
    """The record saying that ``record``'s source is stored now."""
    return RejectRecord(RESOLVED, "ingest", "stored by a later ingest: the earlier records of this source are "
                        "superseded", record.source, series=record.series)
