"""Deprecated: the cache tiers are the store's read path and moved under it, to :mod:`medload.storage.cache`.
``medload.cache.lru``, ``.hot_shards`` and ``.tiered`` still import, with a DeprecationWarning, until the
next release."""
