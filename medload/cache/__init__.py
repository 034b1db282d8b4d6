"""Slice caching tiers: in-process LRU, local-SSD hot-shard directory, LMDB shards."""
