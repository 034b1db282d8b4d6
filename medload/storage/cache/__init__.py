"""The store's read path, tier by tier: in-process LRU (`lru`), local-SSD hot-shard directory (`hot_shards`),
the LMDB shards, and the resolver that tries them in that order (`tiered`)."""
