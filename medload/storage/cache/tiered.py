"""Which file serves a shard: its verified copy in the hot directory (L2) or the store's own (L3).

Per process, a resolver remembers where each shard was last found, and looks again for a hot copy of
a shard read from the store at most every few seconds (a copy fetched by another worker, or by this
process's background thread, is then picked up). A hot copy that turns out damaged is dropped and the
read falls back to the store; the copy is fetched again.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import lmdb

from medload.config import CacheConfig
from medload.errors import StoreError
from medload.storage import shard as sh
from medload.storage.cache.hot_shards import HotShards
from medload.storage.manifest import ShardEntry, shard_path

__all__ = ["ShardResolver", "TierStats"]

log = logging.getLogger(__name__)

_RECHECK_SECONDS = 2.0


@dataclass
class TierStats:
    """Slices read from one tier by this process (L2, L3), the bytes of their stored values, and
    L2 misses (reads of a shard that had no hot copy yet) and drops (damaged copies thrown away)."""

    hits: int = 0
    misses: int = 0
    bytes: int = 0
    drops: int = 0


@dataclass
class _Where:
    tier: str          # "l2" or "l3"
    path: Path
    checked: float = field(default_factory=time.monotonic)


class ShardResolver:
    """Opens shards for reading through the fastest tier that holds them (one resolver per Store)."""

    def __init__(self, root: Path, cache: CacheConfig) -> None:
        self.root = root
        self.cache = cache
        self.hot = HotShards(cache.hot_dir, cache.hot_budget, max_rate=cache.max_rate) if cache.hot_dir else None
        self._pid = os.getpid()
        self._where: dict[str, _Where] = {}
        self.l2, self.l3 = TierStats(), TierStats()

    def _fresh(self) -> None:
        if self._pid != os.getpid():  # a forked child: start with no process-local state
            self._pid = os.getpid()
            self._where = {}
            self.l2, self.l3 = TierStats(), TierStats()

    def env(self, entry: ShardEntry) -> tuple[lmdb.Environment, str, Path]:
        """The environment to read ``entry`` from, its tier (``"l2"`` or ``"l3"``) and its path (a shard
        directory, or a hot copy's single file); a file of another size than ``entry`` records is not
        opened (ShardUnavailableError, see :func:`~medload.storage.shard.open_read_env`)."""
        self._fresh()
        where = self._where.get(entry.name)
        now = time.monotonic()
        if where is None or (where.tier == "l3" and self.hot is not None and now - where.checked > _RECHECK_SECONDS):
            where = self._where[entry.name] = self._locate(entry)
        try:
            return sh.reader_env(where.path, entry.bytes), where.tier, where.path
        except (StoreError, lmdb.Error):
            if where.tier != "l2":
                raise
            # evicted or deleted between lookup and open: read the store this time
            where = self._where[entry.name] = _Where("l3", shard_path(self.root, entry.name))
            return sh.reader_env(where.path, entry.bytes), where.tier, where.path

    def _locate(self, entry: ShardEntry) -> _Where:
        source = shard_path(self.root, entry.name)
        if self.hot is None:
            return _Where("l3", source)
        local = self.hot.path_of(entry)
        if local is not None:
            return _Where("l2", local)
        self.l2.misses += 1
        if self.cache.fetch == "background":
            self.hot.fetch_in_background(source / "data.mdb", entry)
        return _Where("l3", source)

    def stats(self) -> dict[str, dict[str, int] | None]:
        self._fresh()
        return {"l2": asdict(self.l2) if self.hot is not None else None, "l3": asdict(self.l3)}

    def close(self) -> None:
        """Close this process's handles on hot copies."""
        sh.close_reader_envs([w.path for w in self._where.values() if w.tier == "l2"])
        self._where = {}

    def count(self, tier: str, slices: int, nbytes: int) -> None:
        stats = self.l2 if tier == "l2" else self.l3
        stats.hits += slices
        stats.bytes += nbytes

    def damaged(self, entry: ShardEntry, error: Exception) -> None:
        """A read from the hot copy failed its checks: drop the copy, read the store, fetch again."""
        log.warning("hot copy of shard %s is damaged (%s); reading the store and fetching it again", entry.name, error)
        self.l2.drops += 1
        bad = self._where.get(entry.name)
        source = shard_path(self.root, entry.name)
        self._where[entry.name] = _Where("l3", source)
        if bad is not None and bad.tier == "l2":
            sh.close_reader_envs([bad.path])
        if self.hot is not None:
            self.hot.drop(entry.name)
            if self.cache.fetch == "background":
                self.hot.fetch_in_background(source / "data.mdb", entry)
