"""The cuda_paged descriptor: what it supports and which classes implement it."""

from __future__ import annotations

from typing import Any, ClassVar

from pagedcore.attention.backend import (
    AttentionBackend,
    AttentionConfig,
    AttentionImpl,
    CudaGraphSupport,
    MetadataBuilder,
)
from pagedcore_cuda_paged.impl import SUPPORTED_HEAD_SIZES
from pagedcore_cuda_paged.layout import kv_cache_shape

__all__ = ["CudaPagedBackend"]


class CudaPagedBackend(AttentionBackend):
    """pagedcore's own CUDA kernels (csrc/): 16-byte-vector K/V layout, tensor-core
    (flash-decoding style) and CUDA-core decode, one pass or partitioned, FlashAttention-2
    style tensor-core prefill over the paged cache.

    KV cache per layer: ``[2, num_blocks, num_kv_heads * head_size * block_size]``, K and V
    views described in `pagedcore_cuda_paged.layout`.

    Prefill: prompts with nothing cached before them go to triton's Hopper prefill kernel
    where it runs (``prefill:triton`` in ``pagedcore backends``; `pagedcore_cuda_paged.handoff`),
    the other prefills to csrc/'s.

    CUDA graphs: uniform single-token decode steps (`build_for_cudagraph_capture` plans the
    launch for the largest length; the forward pass makes no host reads of device data).
    """

    name: ClassVar[str] = "cuda_paged"
    priority: ClassVar[int] = 30
    priority_reason: ClassVar[str | None] = (
        "between triton (20) and flashinfer (35): `pagedcore bench engine` on the H200 "
        "(qwen2-0.5b-shaped, bf16, each backend forced in one run, decode steps as CUDA "
        "graphs) gave triton 10,827, cuda_paged 6,413 and flashinfer 3,999 tok/s "
        "(docs/benchmarks/h200_s12_fi/round2/engine_*.json); on the prefill-heavy stage "
        "(4 x 8192-token prompts) it ties triton (230,765 against 224,096 prompt tok/s, "
        "docs/benchmarks/h200_s12_fi/round3/engine_prefill_*.json)"
    )
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float16", "bfloat16", "float32")
    #: fp8: quantized at the cache write, dequantized inside decode_fp8 / prefill_fp8 (block
    #: sizes 16 and 32 only: 16 fp8 elements per 16-byte vector; see `validate_configuration`).
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto", "fp8_e4m3", "fp8_e5m2")
    supported_head_sizes: ClassVar[tuple[int, ...] | None] = SUPPORTED_HEAD_SIZES
    supported_block_sizes: ClassVar[tuple[Any, ...]] = (8, 16, 32)
    supported_devices: ClassVar[tuple[str, ...]] = ("cuda",)
    supports_sliding_window: ClassVar[bool] = True
    supports_alibi: ClassVar[bool] = True
    supports_logits_soft_cap: ClassVar[bool] = True
    #: Prompts with no cached context run on triton's Hopper prefill kernel where the triton
    #: backend is installed and the GPU is compute capability 9.x (`pagedcore_cuda_paged.handoff`).
    prefill_handoff: ClassVar[str | None] = "triton"
    cudagraph_support: ClassVar[CudaGraphSupport] = (
        CudaGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE
    )

    @classmethod
    def validate_configuration(cls, cfg: AttentionConfig) -> list[str]:
        reasons = super().validate_configuration(cfg)
        if cfg.kv_cache_dtype != "auto" and cfg.block_size in (8,):
            reasons.append(
                f"an fp8 KV cache needs block size 16 or 32 (16 fp8 elements per 16-byte "
                f"vector), got {cfg.block_size}"
            )
        return reasons

    @classmethod
    def is_available(cls) -> str | None:
        from pagedcore_cuda_paged._ext import unavailable_reason

        return unavailable_reason()

    @classmethod
    def get_builder_cls(cls) -> type[MetadataBuilder[Any]]:
        from pagedcore_cuda_paged.metadata import CudaPagedMetadataBuilder

        return CudaPagedMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl[Any]]:
        from pagedcore_cuda_paged.impl import CudaPagedImpl

        return CudaPagedImpl

    @classmethod
    def get_kv_cache_shape(
        cls,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype: str = "auto",
    ) -> tuple[int, ...]:
        return kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype)
