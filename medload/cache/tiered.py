"""Deprecated alias of :mod:`medload.storage.cache.tiered` (the cache tiers moved under the store); goes in the
next release."""

import warnings

from medload.storage.cache.tiered import ShardResolver, TierStats

__all__ = ["ShardResolver", "TierStats"]

warnings.warn("medload.cache.tiered moved to medload.storage.cache.tiered: import it from there (the old name goes in "
              "the next release)", DeprecationWarning, stacklevel=2)
