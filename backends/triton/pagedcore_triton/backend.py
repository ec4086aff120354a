"""The Triton backend's descriptor, its per-step metadata and the metadata builder."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from pagedcore.attention import (
    AttentionBackend,
    AttentionImpl,
    CommonAttentionMetadata,
    CudaGraphSupport,
    MetadataBuilder,
    MultipleOf,
    split_decodes_and_prefills,
)
from pagedcore_triton._env import interpreting, triton_unavailable_reason
from pagedcore_triton.plan import LaunchPart, SplitRule, choose_num_segments

if TYPE_CHECKING:
    import torch

    from pagedcore.kv_cache.spec import AttentionSpec

__all__ = ["TritonAttentionBackend", "TritonAttentionMetadata", "TritonMetadataBuilder"]


@attrs.frozen(kw_only=True)
class TritonAttentionMetadata:
    """The Triton backend's plan for one step.

    Attributes
    ----------
    query_start_loc:
        ``[B + 1]`` int32 on the device.
    seq_lens:
        ``[B]`` int32 on the device.
    block_table:
        ``[B, max_blocks]`` int32 on the device.
    num_actual_tokens:
        Real query tokens of the step.
    causal:
        Causal masking (decoder self-attention).
    parts:
        The kernel launches of the step, in order (a decode part first when the batch mixes
        decodes and prefills and `TritonMetadataBuilder.separate_decode_launch` is set).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    num_actual_tokens: int
    causal: bool
    parts: tuple[LaunchPart, ...]


class TritonMetadataBuilder(MetadataBuilder[TritonAttentionMetadata]):
    """Plans each step: launch parts (decode vs prefill tiles) and split-KV segments.

    Attributes
    ----------
    split_rule:
        When a decode launch splits its contexts (`SplitRule`); replace to tune.
    separate_decode_launch:
        Serve the decodes of a mixed batch in their own launch with 16-row tiles instead of
        the prefill-sized tiles of one unified launch (measured faster on the H200; see
        ``docs/benchmarks/triton.md``).
    """

    reorder_batch_threshold: ClassVar[int] = 1

    def __init__(
        self, kv_cache_spec: AttentionSpec, layer_names: Sequence[str], device: torch.device
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, device)
        self.split_rule = SplitRule()
        self.separate_decode_launch = True

    def _part(
        self, common: CommonAttentionMetadata, begin: int, end: int, *, allow_split: bool
    ) -> LaunchPart:
        qsl = common.query_start_loc_cpu
        q_lens = (qsl[begin + 1 : end + 1] - qsl[begin:end]).tolist()
        max_q = max(q_lens, default=0)
        max_seq = max(common.seq_lens_cpu[begin:end].tolist(), default=0)
        segments = 1
        if allow_split:
            segments = choose_num_segments(
                self.split_rule,
                num_reqs=end - begin,
                num_kv_heads=self.kv_cache_spec.num_kv_heads,
                max_seq_len=max_seq,
                max_query_len=max_q,
            )
        return LaunchPart(
            req_begin=begin,
            req_end=end,
            token_begin=int(qsl[begin]),
            token_end=int(qsl[end]),
            max_query_len=max_q,
            num_segments=segments,
        )

    def build(
        self, common: CommonAttentionMetadata, *, common_prefix_len: int = 0
    ) -> TritonAttentionMetadata:
        """Plan one step (``common_prefix_len`` is accepted and ignored: no cascade kernel)."""
        num_reqs = common.num_reqs
        parts: list[LaunchPart] = []
        if num_reqs > 0:
            try:
                num_decodes, num_prefills, _, _ = split_decodes_and_prefills(
                    common, self.reorder_batch_threshold
                )
            except ValueError:  # not decode-first: one unified launch
                num_decodes, num_prefills = 0, num_reqs
            if self.separate_decode_launch and num_decodes and num_prefills:
                parts.append(self._part(common, 0, num_decodes, allow_split=True))
                parts.append(self._part(common, num_decodes, num_reqs, allow_split=False))
            else:
                parts.append(self._part(common, 0, num_reqs, allow_split=True))
        return TritonAttentionMetadata(
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            block_table=common.block_table,
            num_actual_tokens=common.num_actual_tokens,
            causal=common.causal,
            parts=tuple(parts),
        )


class _TritonBackendMeta(abc.ABCMeta):
    """Reads ``supported_devices`` from the environment when asked, not when imported."""

    @property
    def supported_devices(cls) -> tuple[str, ...]:
        return ("cuda", "cpu") if interpreting() else ("cuda",)


class TritonAttentionBackend(AttentionBackend, metaclass=_TritonBackendMeta):
    """Paged attention in Triton: one kernel for mixed decode/prefill/chunked-prefill batches.

    Runs on CUDA GPUs; with ``TRITON_INTERPRET=1`` (set before the kernels are first
    imported) it also serves CPU tensors through Triton's interpreter (slow; for tests), and
    then ``supported_devices`` (read at each access) lists ``"cpu"`` too.
    """

    name: ClassVar[str] = "triton"
    priority: ClassVar[int] = 20
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float16", "bfloat16", "float32")
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto",)
    supported_head_sizes: ClassVar[tuple[int, ...] | None] = (64, 80, 96, 112, 128, 192, 256)
    supported_block_sizes: ClassVar[tuple[int | MultipleOf, ...]] = (16, 32, 64)
    supports_sliding_window: ClassVar[bool] = True
    supports_alibi: ClassVar[bool] = True
    supports_logits_soft_cap: ClassVar[bool] = True
    cudagraph_support: ClassVar[CudaGraphSupport] = CudaGraphSupport.NEVER

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
        """``(2, num_blocks, block_size, num_kv_heads, head_size)``; index 0 is K, 1 is V."""
        if cache_dtype not in cls.supported_kv_cache_dtypes:
            raise ValueError(
                f"the triton backend stores the KV cache in the model dtype only "
                f"(cache_dtype 'auto'), got {cache_dtype!r}"
            )
        return (2, num_blocks, block_size, num_kv_heads, head_size)
