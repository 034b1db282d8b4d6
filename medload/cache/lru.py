"""Deprecated alias of :mod:`medload.storage.cache.lru` (the cache tiers moved under the store); goes in the
next release."""

import warnings

from medload.storage.cache.lru import LRUStats, SliceLRU, cap_shared, shared_lru

__all__ = ["SliceLRU", "LRUStats", "shared_lru", "cap_shared"]

warnings.warn("medload.cache.lru moved to medload.storage.cache.lru: import it from there (the old name goes in "
              "the next release)", DeprecationWarning, stacklevel=2)
