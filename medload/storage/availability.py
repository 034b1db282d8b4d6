"""Which shards of a store can be read: the records of those that can, the keys of those that cannot.

A store opens *degraded* when a shard is missing, has another size than ``store.json`` records (it is
then never mapped: reading past the end of a mapped file kills the process), is not an LMDB file, or
holds other records than ``store.json`` lists for it (files swapped or replaced). Such a shard takes
part in :func:`~medload.storage.live.merge` by its listed keys, so its series are *unavailable*, never
replaced by older copies; every other series reads as before. Readers and the writer share this.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import lmdb

from medload.errors import ShardUnavailableError, StoreError, StorePermissionError
from medload.storage import shard as sh
from medload.storage.live import LiveRecords, ShardRecords, lost_shard, read_shard
from medload.storage.manifest import Manifest, ShardEntry, shard_path

__all__ = ["Unavailable", "read_shards", "check_keys", "unavailable", "repair_hint"]

log = logging.getLogger(__name__)
_warned: set[tuple[Path, str, str]] = set()  # (store, shard, reason) this process has warned of


@dataclass(frozen=True)
class Unavailable:
    """A shard that cannot be read, why, and the hex keys of the series and labels whose live copy it
    holds (None: ``store.json`` does not list them, as a format-2 manifest does not)."""

    shard: str
    reason: str
    series: tuple[str, ...] | None
    labels: tuple[str, ...] | None


def repair_hint(root: Path) -> str:
    """What to do about a shard that cannot be read."""
    return (f"restore the shard from a backup, or ingest its series again with `medload repair {root} --sources DIR` "
            f"(`medload verify {root}` names the damage)")


def check_keys(entry: ShardEntry, found: ShardRecords) -> None:
    """ShardUnavailableError when a shard holds other records than ``store.json`` lists for it."""
    if entry.keys is None or found.keys() == entry.keys:
        return
    listed, held = set(entry.keys.series), set(found.keys().series)
    raise ShardUnavailableError(f"it holds other records than store.json lists for it ({len(held)} series, "
                                f"{len(held & listed)} of the {len(listed)} listed): its files were swapped or replaced")


def read_shards(root: Path, manifest: Manifest, down: dict[str, str] | None = None) -> tuple[list[ShardRecords],
                                                                                              dict[str, str]]:
    """The records of each shard of ``manifest``, in its order, and the shards that cannot be read with the
    reason (those of ``down`` are not read: they are known not to be)."""
    down = dict(down or {})
    shards = []
    for entry in manifest.shards:
        if entry.name not in down:
            try:
                found = read_shard(sh.reader_env(shard_path(root, entry.name), entry.bytes), entry.name)
                check_keys(entry, found)
                shards.append(found)
                continue
            except StorePermissionError:  # not damage: the store is not shared with this user
                raise
            except (StoreError, lmdb.Error) as exc:
                down[entry.name] = str(exc)
                if (root, entry.name, str(exc)) not in _warned:
                    _warned.add((root, entry.name, str(exc)))
                    log.warning("shard %s of %s cannot be read (%s): its series are unavailable; %s", entry.name,
                                root, exc, repair_hint(root))
        shards.append(lost_shard(entry.name, entry.keys))
    return shards, down


def unavailable(manifest: Manifest, live: LiveRecords, down: dict[str, str]) -> list[Unavailable]:
    """The shards of ``down`` with the series and labels whose live copies they hold, in manifest order."""
    out = []
    for entry in manifest.shards:
        if entry.name in down:
            keys = {kind: tuple(sorted(k.hex() for (what, k), s in live.unavailable.items()
                                       if what == kind and s == entry.name)) for kind in ("series", "label")}
            known = entry.keys is not None
            out.append(Unavailable(entry.name, down[entry.name], keys["series"] if known else None,
                                   keys["label"] if known else None))
    return out
