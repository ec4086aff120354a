"""The flashinfer backend's static descriptor."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from pagedcore.attention.backend import AttentionBackend, CudaGraphSupport
from pagedcore.attention.kv_quant import normalize_kv_cache_dtype
from pagedcore_flashinfer import capabilities

if TYPE_CHECKING:
    from pagedcore.attention.backend import AttentionImpl, MetadataBuilder, MultipleOf

__all__ = ["FlashInferBackend"]


class FlashInferBackend(AttentionBackend):
    """FlashInfer (``flashinfer-python >= 0.7.2``) over pagedcore's paged KV cache.

    Decodes run through ``BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)``, prefill
    chunks through ``BatchPrefillWithPagedKVCacheWrapper`` (FA3 on Hopper); a mixed step runs
    both, or the prefill wrapper alone with ``PAGEDCORE_FLASHINFER_MIXED=prefill``. The
    declarations are what those wrappers accept: fp16/bf16, head sizes 64/128/256, sliding
    window (``window_left``) and soft-cap, and an fp8 (e4m3 / e5m2) cache with per-layer scales
    (the cache write quantizes; the kernels read fp8 K/V and widen them on chip). ALiBi is not
    declared: the paged wrappers compute their own slopes from the head count and take none
    from the model.

    Examples
    --------
    >>> from pagedcore import AttentionConfig
    >>> cfg = AttentionConfig(head_size=96, dtype="bfloat16", block_size=16, device="cuda")
    >>> [r for r in FlashInferBackend.validate_configuration(cfg) if r.startswith("head")]
    ['head size 96 not supported (supports 64, 128, 256)']
    """

    name: ClassVar[str] = "flashinfer"
    #: Behind triton (20) and cuda_paged (30): set from the engine bench (`priority_reason`).
    priority: ClassVar[int] = 35
    priority_reason: ClassVar[str | None] = (
        "behind triton (20) and cuda_paged (30): `pagedcore bench engine` on the H200 "
        "(qwen2-0.5b-shaped, bf16, each backend forced in one run, decode steps as CUDA "
        "graphs) gave triton 10,827, cuda_paged 6,413 and flashinfer 3,999 tok/s, and on the "
        "prefill-heavy stage (4 x 8192-token prompts, FA2 prefill) it was the slowest "
        "(93,692 prompt tok/s; docs/benchmarks/h200_s12_fi/round2/engine_*.json), though its "
        "decode kernel is up to 3.4 % faster than triton's at few long requests "
        "(docs/benchmarks/h200_s12_fi/round3/kernels_decode_h200.json)"
    )
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float16", "bfloat16")
    #: fp8 caches through FlashInfer's FA2 kernels with 16-bit queries (``kv_data_type`` fp8;
    #: FA3 takes fp8 KV only with fp8 queries, so an fp8 cache's prefill always runs FA2).
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = capabilities.KV_CACHE_DTYPES
    supported_head_sizes: ClassVar[tuple[int, ...] | None] = capabilities.HEAD_SIZES
    supported_block_sizes: ClassVar[tuple[int | MultipleOf, ...]] = capabilities.BLOCK_SIZES
    supported_devices: ClassVar[tuple[str, ...]] = ("cuda",)
    supports_sliding_window: ClassVar[bool] = True
    supports_alibi: ClassVar[bool] = False
    supports_logits_soft_cap: ClassVar[bool] = True
    #: Uniform decode batches: `build_for_cudagraph_capture` gives each bucket FlashInfer's
    #: ``use_cuda_graph=True`` decode wrappers over fixed buffers, `prepare_replay` re-plans
    #: them before each replay. Confirmed on the H200 (session 11: real graphs replayed the
    #: eager tokens, `test_decode_graphs_on_real_flashinfer`); mixed and prefill steps run
    #: eager (their plan sizes come from the step).
    cudagraph_support: ClassVar[CudaGraphSupport] = CudaGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE

    @classmethod
    def is_available(cls) -> str | None:
        """None when FlashInfer >= 0.7.2 and a compute capability >= 8.0 GPU are present.

        Otherwise the first missing piece: "FlashInfer is not installed; ...", "FlashInfer
        0.6.0 is too old: ...", "needs an NVIDIA CUDA device ...", or why its import failed.
        """
        return capabilities.availability_problem()

    @classmethod
    def get_builder_cls(cls) -> type[MetadataBuilder[Any]]:
        from pagedcore_flashinfer.metadata import FlashInferMetadataBuilder

        return FlashInferMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl[Any]]:
        from pagedcore_flashinfer.impl import FlashInferImpl

        return FlashInferImpl

    @classmethod
    def get_kv_cache_shape(
        cls,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype: str = "auto",
    ) -> tuple[int, ...]:
        """FlashInfer's NHD paged layout ``(num_blocks, 2, block_size, num_kv_heads, head_size)``;
        ``[:, 0]`` is K, ``[:, 1]`` is V (the same shape for an fp8 cache: one byte a value).

        Raises
        ------
        ValueError
            When `cache_dtype` is not one of `supported_kv_cache_dtypes` (``"fp8"`` is read
            as ``"fp8_e4m3"``).
        """
        if normalize_kv_cache_dtype(cache_dtype) not in cls.supported_kv_cache_dtypes:
            raise ValueError(
                f"cache_dtype {cache_dtype!r} is not supported by the flashinfer backend; "
                f"use one of {cls.supported_kv_cache_dtypes}"
            )
        return (num_blocks, 2, block_size, num_kv_heads, head_size)
