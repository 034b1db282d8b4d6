"""L1: decoded slices in an in-process LRU bounded in bytes, shared by every Store of the process.

Keys name immutable content -- (shard digest, sub-database, slice key) -- so a slice read through a
hot copy and through the store itself is the same entry. Cached arrays are read-only; callers get
copies (``Store.read``) or the read-only arrays themselves (``Store.planes``). After a ``fork`` the
child starts with an empty cache of the same budget (DataLoader workers must not grow by touching
the parent's pages).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import numpy as np
from cachetools import LRUCache

__all__ = ["SliceLRU", "LRUStats", "shared_lru"]

CacheKey = tuple[str, bytes, bytes]


@dataclass(frozen=True)
class LRUStats:
    hits: int
    misses: int
    bytes: int
    budget: int
    entries: int
    evictions: int


class _CountingLRU(LRUCache):
    def __init__(self, maxsize: int) -> None:
        super().__init__(maxsize=maxsize, getsizeof=lambda a: a.nbytes)
        self.evictions = 0

    def popitem(self):
        item = super().popitem()
        self.evictions += 1
        return item


class SliceLRU:
    """Decoded slices, at most ``budget`` bytes of array data; thread-safe; exact hit/miss counts."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._cache = _CountingLRU(max(budget, 1))
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: CacheKey) -> np.ndarray | None:
        with self._lock:
            value = self._cache.get(key)
            if value is None:
                self.misses += 1
            else:
                self.hits += 1
            return value

    def put(self, key: CacheKey, array: np.ndarray) -> None:
        """Keep a read-only copy; arrays larger than the whole budget are not cached."""
        if self.budget == 0 or array.nbytes > self.budget:
            return
        value = np.array(array, copy=True)
        value.flags.writeable = False
        with self._lock:
            self._cache[key] = value

    def clear(self) -> None:
        """Drop every cached slice (the counters keep counting)."""
        with self._lock:
            self._cache.clear()

    def stats(self) -> LRUStats:
        with self._lock:
            return LRUStats(self.hits, self.misses, int(self._cache.currsize), self.budget, len(self._cache),
                            self._cache.evictions)


_shared: SliceLRU | None = None
_shared_lock = threading.Lock()


def shared_lru(budget: int) -> SliceLRU:
    """This process's L1. The first caller sets the budget; a larger one asked for later replaces it."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared.budget < budget:
            _shared = SliceLRU(budget)
        return _shared


def _forget_after_fork() -> None:
    global _shared, _shared_lock
    _shared_lock = threading.Lock()
    if _shared is not None:
        _shared = SliceLRU(_shared.budget)


os.register_at_fork(after_in_child=_forget_after_fork)
