"""The flex backend's static descriptor."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from pagedcore.attention.backend import AttentionBackend, CudaGraphSupport, MultipleOf
from pagedcore_flex.availability import availability_problem
from pagedcore_flex.capabilities import HEAD_SIZES

if TYPE_CHECKING:
    from pagedcore.attention.backend import AttentionImpl, MetadataBuilder

__all__ = ["FlexBackend"]


class FlexBackend(AttentionBackend):
    """torch's FlexAttention (``torch.nn.attention.flex_attention``, torch >= 2.5) over the
    paged KV cache.

    The builder turns the block table into a packed gather of each request's visible keys and
    a BlockMask (per-request causal mask aligned to the end of the sequence, sliding window);
    the impl gathers K/V once per layer and runs ``flex_attention`` with a ``score_mod`` for
    soft-cap and ALiBi. On CUDA ``flex_attention`` is compiled once per shape bucket; on CPU it
    runs eagerly (torch's unfused implementation), which is correct but materializes the
    score matrix. Every declaration is exercised by ``pagedcore conformance flex``.

    Examples
    --------
    >>> from pagedcore import AttentionConfig
    >>> cfg = AttentionConfig(head_size=64, dtype="float32", block_size=16, device="cpu")
    >>> FlexBackend.validate_configuration(cfg)
    []
    """

    name: ClassVar[str] = "flex"
    #: Opt-in (``backend="flex"``) until measured: behind every backend, the reference (1000)
    #: included, so it never displaces the CPU default. Set from the side-by-side bench.
    priority: ClassVar[int] = 2000
    priority_reason: ClassVar[str | None] = (
        "opt-in: correct (full conformance on the H200), but its decode ran at 9-11 % of copy "
        "bandwidth against triton's 95-98 % and its prefill at 0.44-0.74x triton's TFLOP/s "
        "(docs/benchmarks/h200_s9/kernels_flex.json)"
    )
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float16", "bfloat16", "float32")
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto",)
    #: flex's compiled kernel wants a power-of-two head size >= 16; eager runs any, but one
    #: declaration must hold on every device.
    supported_head_sizes: ClassVar[tuple[int, ...] | None] = HEAD_SIZES
    #: The gather reads any block size; the flex block mask works on the packed keys.
    supported_block_sizes: ClassVar[tuple[int | MultipleOf, ...]] = (MultipleOf(1),)
    supported_devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    supports_sliding_window: ClassVar[bool] = True
    supports_alibi: ClassVar[bool] = True
    supports_logits_soft_cap: ClassVar[bool] = True
    #: The plan's sizes (packed key count, gather indices) come from this step's host lengths.
    cudagraph_support: ClassVar[CudaGraphSupport] = CudaGraphSupport.NEVER

    @classmethod
    def is_available(cls) -> str | None:
        """None when ``torch.nn.attention.flex_attention`` imports (torch >= 2.5), else why."""
        return availability_problem()

    @classmethod
    def get_builder_cls(cls) -> type[MetadataBuilder[Any]]:
        from pagedcore_flex.metadata import FlexMetadataBuilder

        return FlexMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl[Any]]:
        from pagedcore_flex.impl import FlexImpl

        return FlexImpl

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
            When `cache_dtype` is not ``"auto"``.
        """
        if cache_dtype != "auto":
            raise ValueError(
                f"cache_dtype {cache_dtype!r} is not supported by the flex backend; use 'auto'"
            )
        return (2, num_blocks, block_size, num_kv_heads, head_size)
