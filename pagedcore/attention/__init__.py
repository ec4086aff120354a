"""Backend roles and the per-step metadata they share."""

from pagedcore.attention.backend import (
    KV_CACHE_DTYPE_ALIASES,
    KV_CACHE_DTYPES,
    AttentionBackend,
    AttentionConfig,
    AttentionImpl,
    CudaGraphSupport,
    MetadataBuilder,
    MultipleOf,
)
from pagedcore.attention.metadata import (
    CommonAttentionMetadata,
    decode_first_order,
    split_decodes_and_prefills,
)
from pagedcore.attention.mla import MLAAttentionBackend

__all__ = [
    "KV_CACHE_DTYPES",
    "KV_CACHE_DTYPE_ALIASES",
    "AttentionBackend",
    "AttentionConfig",
    "AttentionImpl",
    "CommonAttentionMetadata",
    "CudaGraphSupport",
    "MLAAttentionBackend",
    "MetadataBuilder",
    "MultipleOf",
    "decode_first_order",
    "split_decodes_and_prefills",
]
