"""Which copy of each series is live, reading shards in the order they were published.

Published shards never change, so ``ingest --force`` replaces a series by writing it again into the
current staging shard together with a marker (key -> ``b""``) in that shard's ``replaced``
sub-database, in the same write transaction: a crash keeps both or neither, and the next writer
publishes what was committed. Reading the manifest's shards in order, a marker supersedes everything
earlier shards hold for its key -- series record, label record and their values -- and the marking
shard's own copy is taken; the labels of a replaced series are those written with it or after it.
Readers (:class:`~medload.storage.store.Store`), the writer and ``medload verify`` share this rule.

A shard that cannot be read takes part by the keys ``store.json`` lists for it (:func:`lost_shard`):
the series and labels whose live copy it holds are *unavailable*, not replaced by earlier copies.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TypeVar

import lmdb

from medload.storage import shard as sh
from medload.storage.manifest import ShardKeys
from medload.storage.records import LabelRecord, SeriesRecord

__all__ = ["ShardRecords", "LiveRecords", "read_shard", "lost_shard", "merge"]

_Rec = TypeVar("_Rec", SeriesRecord, LabelRecord)


@dataclass
class ShardRecords:
    """The records of one shard: those that parse (``shard`` filled in), the keys it marks replaced,
    and ``broken`` records, ``(kind, key) -> reason`` (kind ``"series"`` or ``"label"``). A shard that
    cannot be read holds ``lost`` records instead, ``(kind, key)``, known only by their keys."""

    name: str
    series: dict[bytes, SeriesRecord] = field(default_factory=dict)
    labels: dict[bytes, LabelRecord] = field(default_factory=dict)
    replaced: set[bytes] = field(default_factory=set)
    broken: dict[tuple[str, bytes], str] = field(default_factory=dict)
    lost: set[tuple[str, bytes]] = field(default_factory=set)

    def keys(self) -> ShardKeys:
        """The keys of its records and markers, as ``store.json`` lists them."""
        held = {(kind, k) for kind, k in self.broken} | self.lost | {("series", k) for k in self.series} | {
            ("label", k) for k in self.labels}
        return ShardKeys(series=tuple(sorted(k.hex() for kind, k in held if kind == "series")),
                         labels=tuple(sorted(k.hex() for kind, k in held if kind == "label")),
                         replaced=tuple(sorted(k.hex() for k in self.replaced)))


@dataclass
class LiveRecords:
    """The live copies: series and label records by key, ``broken`` live records ``(kind, key) ->
    (shard, reason)``, ``superseded`` keys per shard (copies a later shard replaced), and
    ``duplicates``: ``(kind, key, earlier shard, later shard)`` of a record held twice with no marker
    (the later copy is taken). ``unavailable``: ``(kind, key) -> shard`` of live copies in shards that
    cannot be read."""

    series: dict[bytes, SeriesRecord] = field(default_factory=dict)
    labels: dict[bytes, LabelRecord] = field(default_factory=dict)
    broken: dict[tuple[str, bytes], tuple[str, str]] = field(default_factory=dict)
    unavailable: dict[tuple[str, bytes], str] = field(default_factory=dict)
    superseded: dict[str, set[bytes]] = field(default_factory=dict)
    duplicates: list[tuple[str, bytes, str, str]] = field(default_factory=list)


def read_shard(env: lmdb.Environment, name: str,
               check: Callable[[SeriesRecord | LabelRecord, bytes], None] | None = None) -> ShardRecords:
    """Series and label records and replacement markers of shard ``name``; a record that does not
    parse, or that ``check(record, key)`` refuses with ValueError/TypeError, is listed as broken."""
    out = ShardRecords(name)
    with env.begin(buffers=True) as txn:
        dbs = sh.open_dbs(env, [sh.SERIES, sh.LABEL_SERIES, sh.REPLACED], create=False, txn=txn)
        if sh.SERIES in dbs:
            _parse_into(txn.cursor(db=dbs[sh.SERIES]), "series", SeriesRecord.from_json, out.series, out, check)
        if sh.LABEL_SERIES in dbs:
            _parse_into(txn.cursor(db=dbs[sh.LABEL_SERIES]), "label", LabelRecord.from_json, out.labels, out, check)
        if sh.REPLACED in dbs:
            out.replaced.update(bytes(k) for k in txn.cursor(db=dbs[sh.REPLACED]).iternext(values=False))
    return out


def _parse_into(items: Iterable[tuple[memoryview, memoryview]], kind: str, parse: Callable[[bytes], _Rec],
                into: dict[bytes, _Rec], out: ShardRecords,
                check: Callable[[SeriesRecord | LabelRecord, bytes], None] | None) -> None:
    """Parse the ``kind`` records of ``items`` (key, value) into ``into`` (shard ``out.name`` filled in);
    those that do not parse, or that ``check`` refuses, go to ``out.broken``."""
    for k, v in items:
        key = bytes(k)
        try:
            rec = parse(bytes(v))
            if check is not None:
                check(rec, key)
        except (ValueError, TypeError) as exc:
            out.broken[(kind, key)] = str(exc)
            continue
        into[key] = replace(rec, shard=out.name)


def lost_shard(name: str, keys: ShardKeys | None) -> ShardRecords:
    """The records of a shard that cannot be read, as far as ``store.json`` lists them (None: nothing known)."""
    keys = keys or ShardKeys()
    return ShardRecords(name, replaced={bytes.fromhex(k) for k in keys.replaced},
                        lost={("series", bytes.fromhex(k)) for k in keys.series}
                        | {("label", bytes.fromhex(k)) for k in keys.labels})


def merge(shards: Iterable[ShardRecords]) -> LiveRecords:
    """The live copies of the records of ``shards``, given in manifest (publish) order."""
    live = LiveRecords()
    held: dict[tuple[str, bytes], str] = {}  # (kind, key) -> shard of its live copy, parsed or broken
    for s in shards:
        for key in s.replaced:
            for kind in ("series", "label"):
                old = held.pop((kind, key), None)
                if old is not None:
                    live.superseded.setdefault(old, set()).add(key)
                live.broken.pop((kind, key), None)
                live.unavailable.pop((kind, key), None)
            live.series.pop(key, None)
            live.labels.pop(key, None)
        found = [(("series", k), r) for k, r in s.series.items()] + [(("label", k), r) for k, r in s.labels.items()]
        for (kind, key), rec in found + list(s.broken.items()) + [(held_key, None) for held_key in s.lost]:
            if (kind, key) in held and rec is not None:
                live.duplicates.append((kind, key, held[(kind, key)], s.name))
            held[(kind, key)] = s.name
            into = live.series if kind == "series" else live.labels
            live.broken.pop((kind, key), None)
            live.unavailable.pop((kind, key), None)
            if isinstance(rec, str):  # the reason a record does not parse
                into.pop(key, None)
                live.broken[(kind, key)] = (s.name, rec)
            elif rec is None:  # held by a shard that cannot be read
                into.pop(key, None)
                live.unavailable[(kind, key)] = s.name
            elif isinstance(rec, SeriesRecord):  # found in s.series
                live.series[key] = rec
            else:  # found in s.labels
                live.labels[key] = rec
    return live
