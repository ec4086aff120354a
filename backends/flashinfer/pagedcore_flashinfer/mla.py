"""The ``flashinfer_mla`` backend's builder and impl: pagedcore's paged latent cache through
FlashInfer's ``BatchMLAPagedAttentionWrapper`` (flashinfer-python 0.7.2).

Roles, as for the ``flashinfer`` backend:

* `FlashInferMLAMetadataBuilder.build` turns the block table into FlashInfer's CSR arrays once
  per step (``qo_indptr`` / ``kv_len_arr`` on the host, ``kv_indices`` gathered on the device
  with host-known sizes); the first layer of a step plans the wrapper kept for its
  (heads, widths, scale, dtype) and every other layer runs on that plan.
* `FlashInferMLAImpl.forward` runs the plan on the packed query ``[T, H, L + R]`` and the
  packed cache ``[num_blocks, block_size, L + R]`` (pagedcore's MLA layout is FlashInfer's
  packed one, so nothing is copied), writing ``[T, H, L]``.

FlashInfer 0.7.2's FA2/FA3 MLA kernels serve ``kv_lora_rank = 512`` with ``rope_head_dim = 64``
(DeepSeek's widths), fp16/bf16 with the cache in the model dtype; that is what
`FlashInferMLABackend` (``mla_backend.py``) declares.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import torch

from pagedcore.attention.backend import MetadataBuilder
from pagedcore.reference.mla import MLAImplBase
from pagedcore_flashinfer import fi_api
from pagedcore_flashinfer.capabilities import MLA_DIMS
from pagedcore_flashinfer.planning import check_table_capacity, paged_kv, workspace

if TYPE_CHECKING:
    from pagedcore.attention.metadata import CommonAttentionMetadata
    from pagedcore.kv_cache.spec import AttentionSpec

__all__ = [
    "FlashInferMLAImpl",
    "FlashInferMLAMetadata",
    "FlashInferMLAMetadataBuilder",
    "MLAParams",
    "mla_kernel_backend",
]

def mla_kernel_backend() -> str:
    """The MLA kernels asked of FlashInfer: ``"fa2"``.

    FlashInfer's ``"auto"`` policy may try (and JIT-build) several candidates per plan; one
    named family keeps the first use to a single module per dtype and makes the prebuilt
    cache (tools/prebuild_jit.py) predictable.
    """
    return "fa2"


@attrs.frozen
class MLAParams:
    """The per-layer arguments of the MLA ``plan()``; layers that agree share a plan."""

    num_heads: int
    kv_lora_rank: int
    rope_head_dim: int
    sm_scale: float
    dtype: torch.dtype


@attrs.frozen(kw_only=True)
class FlashInferMLAMetadata:
    """One step's plan inputs, shared by every MLA layer of the group.

    Attributes
    ----------
    num_reqs, num_actual_tokens:
        ``B`` and the real tokens of the step (rows past it are padding, not computed).
    qo_indptr:
        ``[B + 1]`` int32 on the CPU: query offsets.
    kv_indptr:
        ``[B + 1]`` int32 on the CPU: page offsets (`PagedKV.indptr`).
    kv_indices:
        ``[kv_indptr[-1]]`` int32 on the device: physical blocks, request by request.
    kv_len_arr:
        ``[B]`` int32 on the CPU: each request's KV length.
    generation:
        Step counter of the builder; a plan made for another generation is stale.
    planner:
        The builder that owns the wrappers.
    """

    num_reqs: int
    num_actual_tokens: int
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_len_arr: torch.Tensor
    generation: int
    planner: FlashInferMLAMetadataBuilder


class FlashInferMLAMetadataBuilder(MetadataBuilder[FlashInferMLAMetadata]):
    """CSR page arrays once per step; one planned MLA wrapper per distinct `MLAParams`."""

    reorder_batch_threshold: ClassVar[int] = 1

    def __init__(
        self, kv_cache_spec: AttentionSpec, layer_names: Sequence[str], device: torch.device
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, device)
        self._generation = 0
        self._workspace: torch.Tensor | None = None
        self._wrappers: dict[MLAParams, tuple[Any, int]] = {}
        self._api: fi_api.FlashInferMLAAPI | None = None

    def build(
        self, common: CommonAttentionMetadata, *, common_prefix_len: int = 0
    ) -> FlashInferMLAMetadata:
        """Plan one step's page arrays.

        Raises
        ------
        ValueError
            When the block table has too few columns for the longest sequence.
        """
        block_size = self.kv_cache_spec.block_size
        check_table_capacity(common.block_table, block_size, common.num_reqs, common.max_seq_len)
        num_reqs = common.num_reqs
        seq_lens = common.seq_lens_cpu[:num_reqs]
        pages = paged_kv(common.block_table, seq_lens, block_size, 0, num_reqs)
        self._generation += 1
        return FlashInferMLAMetadata(
            num_reqs=num_reqs,
            num_actual_tokens=common.num_actual_tokens,
            qo_indptr=common.query_start_loc_cpu[: num_reqs + 1].to(torch.int32),
            kv_indptr=pages.indptr,
            kv_indices=pages.indices,
            kv_len_arr=seq_lens.to(torch.int32),
            generation=self._generation,
            planner=self,
        )

    def planned_wrapper(self, metadata: FlashInferMLAMetadata, params: MLAParams) -> Any:
        """The MLA wrapper for `params`, planned for `metadata`'s step (once per step).

        Raises
        ------
        RuntimeError
            When FlashInfer refuses the plan, naming the layer's shape and the way out.
        """
        api = self._load()
        wrapper, generation = self._wrappers.get(params, (None, -1))
        if wrapper is None:
            wrapper = api.BatchMLAPagedAttentionWrapper(
                self._workspace_buffer(), backend=mla_kernel_backend()
            )
        if generation != metadata.generation:
            plan_metadata = api.MLAPlanMetadata.csr(
                metadata.qo_indptr, metadata.kv_indptr, metadata.kv_indices, metadata.kv_len_arr
            )
            try:
                wrapper.plan(
                    metadata=plan_metadata,
                    num_heads=params.num_heads,
                    head_dim_ckv=params.kv_lora_rank,
                    head_dim_kpe=params.rope_head_dim,
                    page_size=self.kv_cache_spec.block_size,
                    causal=True,
                    sm_scale=params.sm_scale,
                    q_data_type=params.dtype,
                    kv_data_type=params.dtype,
                )
            except (ValueError, RuntimeError, NotImplementedError) as err:
                raise RuntimeError(
                    f"FlashInfer's MLA kernels refused this step ({params.num_heads} heads, "
                    f"kv_lora_rank {params.kv_lora_rank}, rope_head_dim {params.rope_head_dim}, "
                    f"{params.dtype}): {err}; pick another MLA backend (backend='triton_mla')"
                ) from err
        self._wrappers[params] = (wrapper, metadata.generation)
        return wrapper

    def _load(self) -> fi_api.FlashInferMLAAPI:
        if self._api is None:
            self._api = fi_api.load_flashinfer_mla()
        return self._api

    def _workspace_buffer(self) -> torch.Tensor:
        if self._workspace is None:
            self._workspace = workspace(self.device)
        return self._workspace


class FlashInferMLAImpl(MLAImplBase[FlashInferMLAMetadata]):
    """One MLA layer over FlashInfer's paged MLA wrapper; parameters as `MLAImplBase`."""

    unsupported_features: ClassVar[str] = (
        "the flashinfer_mla backend supports neither ALiBi, sliding window nor soft-cap"
    )

    def check_supported(self) -> None:
        super().check_supported()
        dims = (self.kv_lora_rank, self.head_size - self.kv_lora_rank)
        if dims not in MLA_DIMS:
            raise ValueError(
                f"kv_lora_rank {dims[0]} with rope_head_dim {dims[1]} is not served by "
                f"FlashInfer's MLA kernels (they serve (kv_lora_rank, rope_head_dim) in "
                f"{MLA_DIMS}); pick another MLA backend (backend='triton_mla')"
            )
        if self.kv_cache_dtype != "auto":
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported by the "
                "flashinfer_mla backend; use kv_cache_dtype='auto'"
            )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: FlashInferMLAMetadata,
        *,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Latent-space attention for the step's real tokens through FlashInfer.

        Parameters
        ----------
        query:
            ``[T, H, L + R]`` float16/bfloat16 (absorbed ``q_nope`` then roped ``q_pe``).
        key, value:
            Ignored (this step's rows are read back from the cache).
        kv_cache:
            ``[num_blocks, block_size, L + R]`` in the query's dtype.
        metadata:
            The step's `FlashInferMLAMetadata`.
        output:
            Optional ``[T, H, L]`` buffer.

        Returns
        -------
        torch.Tensor
            ``[T, H, L]``; rows past ``metadata.num_actual_tokens`` are left untouched.
        """
        lat = self.kv_lora_rank
        if kv_cache.dim() != 3 or kv_cache.shape[-1] != self.head_size:
            raise ValueError(
                f"kv_cache has shape {tuple(kv_cache.shape)}; the flashinfer_mla backend "
                f"expects [num_blocks, block_size, {self.head_size}]"
            )
        if output is None:
            output = query.new_empty(query.shape[0], query.shape[1], lat)
        num_tokens = metadata.num_actual_tokens
        if metadata.num_reqs == 0 or num_tokens == 0:
            return output
        params = MLAParams(
            num_heads=self.num_heads,
            kv_lora_rank=lat,
            rope_head_dim=self.head_size - lat,
            sm_scale=self.scale,
            dtype=query.dtype,
        )
        wrapper = metadata.planner.planned_wrapper(metadata, params)
        q = query[:num_tokens]
        if not q.is_contiguous():
            q = q.contiguous()
        wrapper.run(query=q, kv_cache=kv_cache, out=output[:num_tokens])
        return output
