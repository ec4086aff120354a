"""KV-cache specs and management: hashing, block pool, managers, coordinators."""

from pagedcore.kv_cache.spec import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

__all__ = [
    "AttentionSpec",
    "ChunkedLocalAttentionSpec",
    "FullAttentionSpec",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheSpec",
    "KVCacheTensor",
    "MLAAttentionSpec",
    "SlidingWindowSpec",
]
