"""L1: decoded slices in an in-process LRU bounded in bytes, shared by every Store of the process.

Keys name immutable content -- (shard digest, sub-database, slice key) -- so a slice read through a
hot copy and through the store itself is the same entry. Cached arrays are read-only; callers get
copies (``Store.read``) or the read-only arrays themselves (``Store.planes``). After a ``fork`` the
child starts with an empty cache of the same budget (DataLoader workers must not grow by touching
the parent's pages).

Admission (:meth:`SliceLRU.admits`): while the cache has room every slice is kept; once it is full, a
slice is kept only if it missed before, recently -- its key is among the last misses that were turned
away, as many as the cache holds slices (a "ghost" list of keys, as in 2Q and ARC; Johnson & Shasha
1994, Megiddo & Modha 2003). A random epoch over a store much larger than the cache then leaves the
cache as it is (a slice comes back only after the whole epoch, long after any LRU would have dropped
it) instead of copying in and throwing out every slice it reads; data that fits are kept from their
second read on.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
from cachetools import LRUCache

__all__ = ["SliceLRU", "LRUStats", "shared_lru", "cap_shared"]

CacheKey = tuple[str, bytes, bytes]


@dataclass(frozen=True)
class LRUStats:
    hits: int
    misses: int
    bytes: int
    budget: int
    entries: int
    evictions: int
    declined: int = 0  # misses not kept (see SliceLRU.admits)


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
        self._ghost: OrderedDict[CacheKey, None] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        self.declined = 0

    def __contains__(self, key: CacheKey) -> bool:
        """Whether ``key`` is cached (not counted as a hit or a miss, and not made more recent)."""
        with self._lock:
            return key in self._cache

    def admits(self, key: CacheKey, nbytes: int) -> bool:
        """Whether a slice of ``nbytes`` that just missed should be kept (see the module docstring);
        a slice turned away is remembered, and kept if it misses again soon."""
        if self.budget == 0 or nbytes > self.budget:
            return False
        with self._lock:
            if self._cache.currsize + nbytes <= self.budget:
                return True
            if key in self._ghost:
                del self._ghost[key]
                return True
            self._ghost[key] = None
            while len(self._ghost) > max(64, self.budget // nbytes):
                self._ghost.popitem(last=False)
            self.declined += 1
            return False

    def get(self, key: CacheKey) -> np.ndarray | None:
        with self._lock:
            value = self._cache.get(key)
            if value is None:
                self.misses += 1
            else:
                self.hits += 1
            return value

    def put(self, key: CacheKey, array: np.ndarray, *, copy: bool = True) -> None:
        """Keep a read-only copy (``copy=False``: keep ``array`` itself, made read-only; it must own its
        memory); arrays larger than the whole budget are not cached."""
        if self.budget == 0 or array.nbytes > self.budget:
            return
        value = np.array(array, copy=True) if copy else array
        value.flags.writeable = False
        with self._lock:
            self._cache[key] = value

    def clear(self) -> None:
        """Drop every cached slice (the counters keep counting)."""
        with self._lock:
            self._cache.clear()
            self._ghost.clear()

    def stats(self) -> LRUStats:
        with self._lock:
            return LRUStats(self.hits, self.misses, int(self._cache.currsize), self.budget, len(self._cache),
                            self._cache.evictions, self.declined)


_shared: SliceLRU | None = None
_shared_lock = threading.Lock()


def shared_lru(budget: int) -> SliceLRU:
    """This process's L1. The first caller sets the budget; a larger one asked for later replaces it."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared.budget < budget:
            _shared = SliceLRU(budget)
        return _shared


def cap_shared(budget: int) -> None:
    """Make this process's L1 at most ``budget`` bytes, dropping what it holds if it was larger (a
    DataLoader worker taking its share of the loader's budget, before it reads)."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared.budget > budget:
            _shared = SliceLRU(budget)


def _forget_after_fork() -> None:
    global _shared, _shared_lock
    _shared_lock = threading.Lock()
    if _shared is not None:
        _shared = SliceLRU(_shared.budget)


os.register_at_fork(after_in_child=_forget_after_fork)
