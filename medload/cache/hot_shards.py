"""Deprecated alias of :mod:`medload.storage.cache.hot_shards` (the cache tiers moved under the store); goes in the
next release."""

import warnings

from medload.storage.cache.hot_shards import HotEntry, HotShards, HotStatus

__all__ = ["HotEntry", "HotStatus", "HotShards"]

warnings.warn("medload.cache.hot_shards moved to medload.storage.cache.hot_shards: import it from there (the old name goes in "
              "the next release)", DeprecationWarning, stacklevel=2)
