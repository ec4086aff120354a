"""The Triton backend's descriptor (its metadata and builder are in `pagedcore_triton.metadata`)."""

from __future__ import annotations

import abc
from typing import Any, ClassVar

from pagedcore.attention import (
    AttentionBackend,
    AttentionImpl,
    CudaGraphSupport,
    MetadataBuilder,
    MultipleOf,
)
from pagedcore.attention.kv_quant import normalize_kv_cache_dtype
from pagedcore_triton._env import interpreting, triton_unavailable_reason
from pagedcore_triton.capabilities import HEAD_SIZES, KV_CACHE_DTYPES
from pagedcore_triton.metadata import (
    DECODE_PLAN_ENV,
    MIXED_PLAN_ENV,
    TritonAttentionMetadata,
    TritonMetadataBuilder,
)

__all__ = [
    "DECODE_PLAN_ENV",
    "MIXED_PLAN_ENV",
    "TritonAttentionBackend",
    "TritonAttentionMetadata",
    "TritonMetadataBuilder",
]


class _TritonBackendMeta(abc.ABCMeta):
    """Reads ``supported_devices`` from the environment when asked, not when imported."""

    @property
    def supported_devices(cls) -> tuple[str, ...]:
        return ("cuda", "cpu") if interpreting() else ("cuda",)


class TritonAttentionBackend(AttentionBackend, metaclass=_TritonBackendMeta):
    """Paged attention in Triton: one kernel for mixed decode/prefill/chunked-prefill batches.

    Serves fp8 KV caches (quantized in the cache write, dequantized in registers) and
    attention sinks. Runs on CUDA GPUs; with ``TRITON_INTERPRET=1`` (set before the kernels are
    first imported) it also serves CPU tensors through Triton's interpreter (slow; for tests), and
    then ``supported_devices`` (read at each access) lists ``"cpu"`` too.
    """

    name: ClassVar[str] = "triton"
    priority: ClassVar[int] = 20
    priority_reason: ClassVar[str | None] = (
        "fastest correct end to end on the H200: `pagedcore bench engine` (qwen2-0.5b-shaped, "
        "bf16, each backend forced in one run, decode steps as CUDA graphs) 10,827 tok/s "
        "against cuda_paged 6,413 and flashinfer 3,999 "
        "(docs/benchmarks/h200_s12_fi/round2/engine_*.json); its decode kernel is within 3 % "
        "of FlashInfer's at 8 x 32768 with CUDA graphs (1.4-1.9 %) and 2.9-3.4 % behind eager "
        "(docs/benchmarks/h200_s12_fi/round3/kernels_decode_h200.json); on the prefill-heavy "
        "stage it ties cuda_paged (224,096 against 230,765 prompt tok/s, "
        "docs/benchmarks/h200_s12_fi/round3/engine_prefill_*.json)"
    )
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float16", "bfloat16", "float32")
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = KV_CACHE_DTYPES
    supported_head_sizes: ClassVar[tuple[int, ...] | None] = HEAD_SIZES
    supported_block_sizes: ClassVar[tuple[int | MultipleOf, ...]] = (16, 32, 64)
    supports_sliding_window: ClassVar[bool] = True
    supports_alibi: ClassVar[bool] = True
    supports_logits_soft_cap: ClassVar[bool] = True
    supports_sink: ClassVar[bool] = True
    #: Shared-prefix steps (``pagedcore_triton.cascade``), eager and in decode and mixed
    #: CUDA graphs (`TritonMetadataBuilder.build_cascade_for_cudagraph_capture`); layers
    #: with ALiBi, a sliding window, sinks or an fp8 cache compute such steps the plain way.
    supports_cascade: ClassVar[bool] = True
    supports_cascade_cudagraph: ClassVar[bool] = True
    supports_cascade_mixed_cudagraph: ClassVar[bool] = True
    #: Uniform decode batches and mixed token buckets, planned by
    #: `TritonMetadataBuilder.build_for_cudagraph_capture`.
    cudagraph_support: ClassVar[CudaGraphSupport] = CudaGraphSupport.ALWAYS

    @classmethod
    def is_available(cls) -> str | None:
        return triton_unavailable_reason()

    @classmethod
    def get_builder_cls(cls) -> type[MetadataBuilder[Any]]:
        return TritonMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl[Any]]:
        from pagedcore_triton.impl import TritonAttentionImpl

        return TritonAttentionImpl

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

        The same shape for every `cache_dtype`; an fp8 cache is allocated in
        ``torch.float8_e4m3fn`` / ``float8_e5m2`` (`pagedcore.attention.kv_quant`)."""
        if normalize_kv_cache_dtype(cache_dtype) not in cls.supported_kv_cache_dtypes:
            raise ValueError(
                f"the triton backend stores the KV cache as "
                f"{', '.join(cls.supported_kv_cache_dtypes)}, got cache_dtype {cache_dtype!r}"
            )
        return (2, num_blocks, block_size, num_kv_heads, head_size)
