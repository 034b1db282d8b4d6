"""Whether a store still holds exactly the data a lineage record names: ``medload lineage check``.

Each series of the record is looked up by its key among the store's live series (the copy a reader gets:
:mod:`medload.storage.live`) and its stored digest compared with the recorded one; where the record
holds a label digest, the label map's too. A series is

- ``changed``: its voxels differ (ingested again with other pixels, ``ingest --force`` or ``repair``);
- ``labels changed`` / ``labels gone``: its label map differs, or it has none any more;
- ``gone``: the store holds no series of that key (its shard retired by ``repair``, another store);
- ``unavailable``: its live copy is in a shard that cannot be read (``medload repair`` stores it again).

The stored digests are those ingest computed from the voxels; ``medload verify`` checks that the stored
values still hash to them.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

from medload.lineage.record import LineageRecord
from medload.storage.store import Store, open_store

__all__ = ["SeriesChange", "LineageCheck", "check"]


@dataclass(frozen=True)
class SeriesChange:
    """A recorded series the store no longer holds as recorded: its key, what (``changed``, ``labels
    changed``, ``labels gone``, ``gone``, ``unavailable``) and the detail."""

    key: str
    what: str
    detail: str


@dataclass(frozen=True)
class LineageCheck:
    """The outcome of :func:`check`: the record's digest, how many series it names, those that changed
    (record order) and notes that change nothing for the record (other series added, a store rebuilt)."""

    record: str
    series: int
    changes: tuple[SeriesChange, ...] = ()
    notes: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        """Whether the store holds every recorded series (and label map) exactly as recorded."""
        return not self.changes

    def to_dict(self) -> dict:
        return {"record": self.record, "series": self.series, "ok": self.ok,
                "changes": [asdict(c) for c in self.changes], "notes": list(self.notes)}


def check(record: LineageRecord, store: Store | str | os.PathLike) -> LineageCheck:
    """Compare ``store`` with ``record`` series by series (see the module docs).

    Examples:
        >>> record = SliceDataset(store).lineage()
        >>> result = check(record, store)
        >>> result.ok, result.series, result.changes
        (True, 1, ())
    """
    store = store if isinstance(store, Store) else open_store(store, cache=0)
    live = {r.key: r for r in store.series()}
    down = store.unavailable()
    lost = {key: u for u in down for key in u.series or ()}
    lost_labels = {key: u for u in down for key in u.labels or ()}
    unlisted = [u.shard for u in down if u.series is None]  # format-2 shards: which series they held is unknown
    changes = []
    for s in record.series:
        if s.key in lost:
            changes.append(SeriesChange(s.key, "unavailable", f"its shard {lost[s.key].shard} cannot be read "
                                                              f"({lost[s.key].reason}): run `medload repair`"))
        elif s.key not in live:
            maybe = f"; shard {unlisted[0]} cannot be read and may hold it" if unlisted else ""
            changes.append(SeriesChange(s.key, "gone", f"the store holds no series of this key{maybe}"))
        elif live[s.key].digest != s.digest:
            changes.append(SeriesChange(s.key, "changed", f"its voxels differ: digest {live[s.key].digest[:12]} now, "
                                                          f"{s.digest[:12]} recorded"))
        elif s.label is not None:
            changes += _label_change(store, s.key, s.label, lost_labels)
    return LineageCheck(record.digest, len(record.series), tuple(changes), tuple(_notes(record, store, live)))


def _label_change(store: Store, key: str, recorded: str, lost_labels: dict) -> list[SeriesChange]:
    if key in lost_labels:
        return [SeriesChange(key, "unavailable", f"its labels' shard {lost_labels[key].shard} cannot be read: "
                                                 "run `medload repair`")]
    label = store.labels(key)
    if label is None:
        return [SeriesChange(key, "labels gone", "the series has no label map any more (dropped when it was "
                                                 "ingested again): ingest its labels again")]
    if label.digest != recorded:
        return [SeriesChange(key, "labels changed", f"its label map differs: digest {label.digest[:12]} now, "
                                                    f"{recorded[:12]} recorded")]
    return []


def _notes(record: LineageRecord, store: Store, live: dict) -> list[str]:
    notes = []
    if record.store.get("key_fingerprint") not in (None, store.manifest.key_fingerprint):
        notes.append("the store was built with another pseudonymisation key than the recorded one: the same "
                     "series would have other keys here")
    others = len(set(live) - {s.key for s in record.series})
    if others:
        notes.append(f"the store holds {others} series the record does not name (left out, or added since)")
    return notes
