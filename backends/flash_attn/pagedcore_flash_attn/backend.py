"""The flash_attn backend's static descriptor."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from pagedcore.attention.backend import (
    AttentionBackend,
    CudaGraphSupport,
    MultipleOf,
)
from pagedcore_flash_attn import capabilities

if TYPE_CHECKING:
    from pagedcore.attention.backend import AttentionImpl, MetadataBuilder

__all__ = ["FlashAttnBackend"]


class FlashAttnBackend(AttentionBackend):
    """FlashAttention-2 (``flash-attn >= 2.6.2``) over pagedcore's paged KV cache.

    The declarations are what every accepted flash-attn release (2.6.2 through 2.8.3, the
    newest read) supports in ``flash_attn_varlen_func`` with a block table: fp16/bf16, head
    sizes that are multiples of 8 up to 256, blocks of a multiple of 256 tokens, sliding
    window, ALiBi and soft-cap. `is_available` reads the installed version and the device at
    call time and names what is missing.

    Examples
    --------
    >>> from pagedcore import AttentionConfig
    >>> cfg = AttentionConfig(head_size=128, dtype="bfloat16", block_size=16, device="cuda")
    >>> [r for r in FlashAttnBackend.validate_configuration(cfg) if r.startswith("block")]
    ['block size 16 not supported (supports multiple of 256)']
    """

    name: ClassVar[str] = "flash_attn"
    #: Ahead of the Triton backend (20) wherever flash-attn can serve the configuration.
    priority: ClassVar[int] = 10
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float16", "bfloat16")
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto",)
    supported_head_sizes: ClassVar[tuple[int, ...] | None] = capabilities.HEAD_SIZES
    supported_block_sizes: ClassVar[tuple[int | MultipleOf, ...]] = (
        MultipleOf(capabilities.PAGED_BLOCK_MULTIPLE),
    )
    supported_devices: ClassVar[tuple[str, ...]] = ("cuda",)
    supports_sliding_window: ClassVar[bool] = True
    supports_alibi: ClassVar[bool] = True
    supports_logits_soft_cap: ClassVar[bool] = True
    #: Host-side max lengths and the split-KV choice are made per call; never captured.
    cudagraph_support: ClassVar[CudaGraphSupport] = CudaGraphSupport.NEVER

    @classmethod
    def is_available(cls) -> str | None:
        """None when flash-attn >= 2.6.2 and a compute capability >= 8.0 GPU are present.

        Otherwise the first missing piece: "flash-attn is not installed; ...", "flash-attn
        2.5.8 is too old: ...", "needs compute capability >= 8.0 ...".
        """
        return capabilities.availability_problem()

    @classmethod
    def get_builder_cls(cls) -> type[MetadataBuilder[Any]]:
        from pagedcore_flash_attn.metadata import FlashAttnMetadataBuilder

        return FlashAttnMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl[Any]]:
        from pagedcore_flash_attn.impl import FlashAttnImpl

        return FlashAttnImpl

    @classmethod
    def get_kv_cache_shape(
        cls,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype: str = "auto",
    ) -> tuple[int, ...]:
        """``(2, num_blocks, block_size, num_kv_heads, head_size)``; index 0 is K, 1 is V.

        Raises
        ------
        ValueError
            When `block_size` is not a multiple of 256 or `cache_dtype` is not ``"auto"``.
        """
        if block_size % capabilities.PAGED_BLOCK_MULTIPLE != 0:
            raise ValueError(
                f"block_size {block_size} is not a multiple of "
                f"{capabilities.PAGED_BLOCK_MULTIPLE}, which flash-attn's paged KV requires; "
                "use block_size=256 or choose another backend"
            )
        if cache_dtype != "auto":
            raise ValueError(
                f"cache_dtype {cache_dtype!r} is not supported by the flash_attn backend; "
                "use 'auto'"
            )
        return (2, num_blocks, block_size, num_kv_heads, head_size)
