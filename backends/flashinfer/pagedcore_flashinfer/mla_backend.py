"""The ``flashinfer_mla`` backend's static descriptor (imports neither FlashInfer nor CUDA)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from pagedcore.attention.backend import CudaGraphSupport, MultipleOf
from pagedcore.attention.mla import MLAAttentionBackend
from pagedcore_flashinfer import capabilities

if TYPE_CHECKING:
    from pagedcore.attention.backend import AttentionImpl, MetadataBuilder

__all__ = ["FlashInferMLABackend"]

MLA_DIMS = capabilities.MLA_DIMS


class FlashInferMLABackend(MLAAttentionBackend):
    """FlashInfer's paged MLA (``BatchMLAPagedAttentionWrapper``, FA2 kernels) over
    pagedcore's latent cache ``[num_blocks, block_size, L + R]``.

    Examples
    --------
    >>> FlashInferMLABackend.supported_mla_dims
    ((512, 64),)
    """

    name: ClassVar[str] = "flashinfer_mla"
    #: Behind triton_mla (20): set from the side-by-side bench (`priority_reason`).
    priority: ClassVar[int] = 25
    priority_reason: ClassVar[str | None] = (
        "behind triton_mla (20): its FA2 MLA decode ran at 0.53-0.56x triton_mla's speed on the "
        "H200 (docs/benchmarks/h200_s11/mla_backends_h200.json)"
    )
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float16", "bfloat16")
    supported_head_sizes: ClassVar[tuple[int, ...] | None] = tuple(
        lat + rope for lat, rope in MLA_DIMS
    )
    supported_mla_dims: ClassVar[tuple[tuple[int, int], ...] | None] = MLA_DIMS
    supported_block_sizes: ClassVar[tuple[int | MultipleOf, ...]] = capabilities.BLOCK_SIZES
    supported_devices: ClassVar[tuple[str, ...]] = ("cuda",)
    #: Not yet run under the engine's graphs (the plan is made on the host per step).
    cudagraph_support: ClassVar[CudaGraphSupport] = CudaGraphSupport.NEVER

    @classmethod
    def is_available(cls) -> str | None:
        """None when FlashInfer >= 0.7.2 and a compute capability >= 8.0 GPU are present."""
        return capabilities.availability_problem()

    @classmethod
    def get_builder_cls(cls) -> type[MetadataBuilder[Any]]:
        from pagedcore_flashinfer.mla import FlashInferMLAMetadataBuilder

        return FlashInferMLAMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl[Any]]:
        from pagedcore_flashinfer.mla import FlashInferMLAImpl

        return FlashInferMLAImpl
