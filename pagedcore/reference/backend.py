"""`ReferenceBackend`: the pure-torch oracle, and the CPU engine's default."""

from __future__ import annotations

from typing import Any, ClassVar

from pagedcore.attention.backend import (
    KV_CACHE_DTYPES,
    AttentionBackend,
    AttentionImpl,
    CudaGraphSupport,
    MetadataBuilder,
    MultipleOf,
)
from pagedcore.attention.kv_quant import normalize_kv_cache_dtype

__all__ = ["ReferenceBackend"]


class ReferenceBackend(AttentionBackend):
    """Pure torch, CPU and CUDA, float32 math; every feature except MLA.

    Priority 1000: chosen only when nothing else fits. The KV cache is one tensor
    ``[2, num_blocks, block_size, num_kv_heads, head_size]`` in the model dtype or an fp8 dtype
    (index 0 = K, 1 = V); block 0 is the null block and never holds data.
    """

    name: ClassVar[str] = "reference"
    priority: ClassVar[int] = 1000
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "float16", "bfloat16")
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = KV_CACHE_DTYPES
    supported_head_sizes: ClassVar[tuple[int, ...] | None] = None
    supported_block_sizes: ClassVar[tuple[int | MultipleOf, ...]] = (MultipleOf(1),)
    supported_devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    supports_sliding_window: ClassVar[bool] = True
    supports_mla: ClassVar[bool] = False
    supports_alibi: ClassVar[bool] = True
    supports_logits_soft_cap: ClassVar[bool] = True
    supports_sink: ClassVar[bool] = True
    #: Accepts any valid ``common_prefix_len`` and computes the step the plain way (the oracle).
    supports_cascade: ClassVar[bool] = True
    cudagraph_support: ClassVar[CudaGraphSupport] = CudaGraphSupport.NEVER

    @classmethod
    def get_builder_cls(cls) -> type[MetadataBuilder[Any]]:
        from pagedcore.reference.metadata import ReferenceMetadataBuilder

        return ReferenceMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl[Any]]:
        from pagedcore.reference.impl import ReferenceImpl

        return ReferenceImpl

    @classmethod
    def get_kv_cache_shape(
        cls,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype: str = "auto",
    ) -> tuple[int, ...]:
        """``(2, num_blocks, block_size, num_kv_heads, head_size)``, in the model dtype or (fp8
        `cache_dtype`) in ``torch.float8_e4m3fn`` / ``float8_e5m2``."""
        for field, value in (
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_size", head_size),
        ):
            if value <= 0:
                raise ValueError(f"{field} must be a positive integer, got {value}")
        if normalize_kv_cache_dtype(cache_dtype) not in cls.supported_kv_cache_dtypes:
            raise ValueError(
                f"the reference backend supports kv_cache_dtype "
                f"{', '.join(cls.supported_kv_cache_dtypes)}, got {cache_dtype!r}"
            )
        return (2, num_blocks, block_size, num_kv_heads, head_size)
