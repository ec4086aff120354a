"""KV-cache specs: what one layer (or one group of layers) stores per block.

Frozen `attrs` classes validated on construction. Dtypes are stored by name (``"bfloat16"``)
so that specs never need torch; `torch.dtype` objects are accepted and converted.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

__all__ = [
    "DTYPE_SIZES",
    "AttentionSpec",
    "ChunkedLocalAttentionSpec",
    "FullAttentionSpec",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheSpec",
    "KVCacheTensor",
    "MLAAttentionSpec",
    "SlidingWindowSpec",
    "cdiv",
]

#: Bytes per element of each dtype a KV cache may hold.
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


def _dtype_name(value: Any) -> str:
    return str(value).removeprefix("torch.")


def _positive(_inst: Any, attribute: attrs.Attribute[int], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{attribute.name} must be a positive integer, got {value!r}")


def _known_dtype(_inst: Any, attribute: attrs.Attribute[str], value: str) -> None:
    if value not in DTYPE_SIZES:
        raise ValueError(
            f"{attribute.name} {value!r} is not a KV-cache dtype; expected one of "
            f"{', '.join(DTYPE_SIZES)}"
        )


@attrs.frozen(kw_only=True)
class KVCacheSpec:
    """Base spec: tokens per block."""

    block_size: int = attrs.field(validator=_positive)

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block of one layer occupies."""
        raise NotImplementedError

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Most bytes one request can hold in one layer at once."""
        raise NotImplementedError


@attrs.frozen(kw_only=True)
class AttentionSpec(KVCacheSpec):
    """A K and a V vector per token and KV head."""

    num_kv_heads: int = attrs.field(validator=_positive)
    head_size: int = attrs.field(validator=_positive)
    dtype: str = attrs.field(converter=_dtype_name, validator=_known_dtype)

    @property
    def element_size(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.element_size

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return cdiv(max_model_len, self.block_size) * self.page_size_bytes


@attrs.frozen(kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Every token attends to the whole history."""


@attrs.frozen(kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """A query at ``p`` sees keys at ``p - sliding_window < k <= p``."""

    sliding_window: int = attrs.field(validator=_positive)

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        # The window behind the oldest token of a step, plus the step itself, plus one block of
        # misalignment at the window's start.
        tokens = min(self.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        return (cdiv(tokens, self.block_size) + 1) * self.page_size_bytes


@attrs.frozen(kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Tokens attend within fixed chunks of ``attention_chunk_size`` positions."""

    attention_chunk_size: int = attrs.field(validator=_positive)

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        tokens = min(self.attention_chunk_size + max_num_batched_tokens, max_model_len)
        return (cdiv(tokens, self.block_size) + 1) * self.page_size_bytes


def _mla_head_size(spec: MLAAttentionSpec) -> int:
    return spec.kv_lora_rank + spec.rope_head_dim


@attrs.frozen(kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention: one latent "head" of ``kv_lora_rank + rope_head_dim``
    values per token, no separate K and V."""

    kv_lora_rank: int = attrs.field(validator=_positive)
    rope_head_dim: int = attrs.field(validator=_positive)
    num_kv_heads: int = attrs.field(default=1, validator=_positive)
    head_size: int = attrs.field(
        default=attrs.Factory(_mla_head_size, takes_self=True), validator=_positive
    )

    def __attrs_post_init__(self) -> None:
        if self.num_kv_heads != 1:
            raise ValueError(f"MLA stores one latent head; num_kv_heads must be 1, got "
                             f"{self.num_kv_heads}")
        if self.head_size != self.kv_lora_rank + self.rope_head_dim:
            raise ValueError(
                f"MLA head_size ({self.head_size}) must equal kv_lora_rank + rope_head_dim "
                f"({self.kv_lora_rank} + {self.rope_head_dim})"
            )

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.head_size * self.element_size


def _str_tuple(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


def _group_tuple(value: Iterable[KVCacheGroupSpec]) -> tuple[KVCacheGroupSpec, ...]:
    return tuple(value)


def _tensor_tuple(value: Iterable[KVCacheTensor]) -> tuple[KVCacheTensor, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class KVCacheGroupSpec:
    """Layers that share one block table (same spec, same block ids)."""

    layer_names: tuple[str, ...] = attrs.field(converter=_str_tuple)
    spec: AttentionSpec

    def __attrs_post_init__(self) -> None:
        if not self.layer_names:
            raise ValueError("a KV-cache group needs at least one layer")


@attrs.frozen(kw_only=True)
class KVCacheTensor:
    """One allocation of ``size_bytes`` shared by `shared_by` layers (one per group)."""

    size_bytes: int = attrs.field(validator=_positive)
    shared_by: tuple[str, ...] = attrs.field(converter=_str_tuple)


@attrs.frozen(kw_only=True)
class KVCacheConfig:
    """A model's whole KV cache: block count, groups and the tensors backing them."""

    num_blocks: int = attrs.field(validator=_positive)
    groups: tuple[KVCacheGroupSpec, ...] = attrs.field(converter=_group_tuple)
    tensors: tuple[KVCacheTensor, ...] = attrs.field(converter=_tensor_tuple, factory=tuple)
