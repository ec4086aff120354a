"""`ToySdpaBackend`: the descriptor. Cheap to import (no torch), so discovery stays fast."""

from __future__ import annotations

from typing import Any, ClassVar

from pagedcore import AttentionBackend, AttentionImpl, MetadataBuilder, MultipleOf

__all__ = ["ToySdpaBackend"]


class ToySdpaBackend(AttentionBackend):
    """Full causal attention over the paged cache, one request at a time, via torch SDPA.

    Declares only what it implements: CPU and CUDA; float32, float16 and bfloat16 (the math
    runs in float32); any head size and block size; GQA/MQA. No sliding window, ALiBi,
    soft-cap, MLA, fp8 cache or CUDA graphs. KV cache layout
    ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (index 0 = K, 1 = V).

    Priority 5000 (the reference backend is 1000): a teaching example should never be chosen
    automatically; select it with ``backend="toy_sdpa"`` or ``PAGEDCORE_BACKEND=toy_sdpa``.
    """

    name: ClassVar[str] = "toy_sdpa"
    priority: ClassVar[int] = 5000
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "float16", "bfloat16")
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto",)
    supported_head_sizes: ClassVar[tuple[int, ...] | None] = None
    supported_block_sizes: ClassVar[tuple[int | MultipleOf, ...]] = (MultipleOf(1),)
    supported_devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")

    @classmethod
    def get_builder_cls(cls) -> type[MetadataBuilder[Any]]:
        from pagedcore_toy_sdpa.impl import ToySdpaMetadataBuilder

        return ToySdpaMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl[Any]]:
        from pagedcore_toy_sdpa.impl import ToySdpaImpl

        return ToySdpaImpl

    @classmethod
    def get_kv_cache_shape(
        cls,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype: str = "auto",
    ) -> tuple[int, ...]:
        """``(2, num_blocks, block_size, num_kv_heads, head_size)``."""
        if cache_dtype != "auto":
            raise ValueError(
                f"toy_sdpa stores K/V in the model dtype only (kv_cache_dtype 'auto'), got "
                f"{cache_dtype!r}; choose another backend for an fp8 cache"
            )
        if min(num_blocks, block_size, num_kv_heads, head_size) <= 0:
            raise ValueError(
                "num_blocks, block_size, num_kv_heads and head_size must be positive, got "
                f"{(num_blocks, block_size, num_kv_heads, head_size)}"
            )
        return (2, num_blocks, block_size, num_kv_heads, head_size)
