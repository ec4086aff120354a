"""KV-cache specs and management: hashing, block pool, managers, coordinators.

Pure Python bookkeeping (no torch): importing it is cheap. See docs/kv-cache.md.
"""

from __future__ import annotations

from pagedcore.kv_cache.config import kv_cache_specs_from_hf_config, make_kv_cache_config
from pagedcore.kv_cache.manager import KVCacheBlocks, KVCacheManager, KVRequest, PrefixCacheStats
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
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheManager",
    "KVCacheSpec",
    "KVCacheTensor",
    "KVRequest",
    "MLAAttentionSpec",
    "PrefixCacheStats",
    "SlidingWindowSpec",
    "kv_cache_specs_from_hf_config",
    "make_kv_cache_config",
]

