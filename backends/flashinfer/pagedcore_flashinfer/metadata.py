"""The flashinfer backend's per-step plan: page arrays built once, wrappers planned once.

`FlashInferMetadataBuilder.build` does the step's host work once for every layer of the group:
it splits the batch into its decode and prefill parts and turns the block table into
FlashInfer's CSR page arrays. FlashInfer's ``plan()`` also needs per-layer facts the builder
does not see (query heads, softmax scale, soft-cap, window), so the first layer of a step
that runs with a given set of them plans the wrappers kept for that set; every later layer
with the same set runs on that plan (one plan per step in the usual model, where all layers
agree).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import torch

from pagedcore.attention.backend import MetadataBuilder
from pagedcore.attention.metadata import split_decodes_and_prefills
from pagedcore_flashinfer import fi_api
from pagedcore_flashinfer.planning import PagedKV, check_table_capacity, paged_kv, workspace

if TYPE_CHECKING:
    from pagedcore.attention.metadata import CommonAttentionMetadata
    from pagedcore.kv_cache.spec import AttentionSpec

__all__ = [
    "MIXED_MODE_ENV",
    "PREFILL_KERNELS_ENV",
    "FlashInferMetadata",
    "FlashInferMetadataBuilder",
    "LayerParams",
    "mixed_mode_from_env",
]

#: ``split`` (default): decodes through the tensor-core decode wrapper, the rest through the
#: prefill wrapper; ``prefill``: the whole step through the prefill wrapper.
MIXED_MODE_ENV = "PAGEDCORE_FLASHINFER_MIXED"
_MIXED_MODES = ("split", "prefill")
#: Which kernels the prefill wrapper asks for: ``auto`` (default: FlashInfer's pick, FA3 on
#: Hopper), ``fa2`` or ``fa3``. The tensor-core decode always runs FlashInfer's FA2 kernels,
#: and so does the prefill of a layer with an fp8 cache (FA3 needs fp8 queries for that).
PREFILL_KERNELS_ENV = "PAGEDCORE_FLASHINFER_PREFILL"
_PREFILL_KERNELS = ("auto", "fa2", "fa3")


def mixed_mode_from_env() -> str:
    """The mixed-step mode named by ``PAGEDCORE_FLASHINFER_MIXED`` (default ``split``).

    Raises
    ------
    ValueError
        When the variable holds anything else, naming the accepted values.
    """
    mode = os.environ.get(MIXED_MODE_ENV, "split").strip().lower() or "split"
    if mode not in _MIXED_MODES:
        raise ValueError(
            f"{MIXED_MODE_ENV}={mode!r} is not a mixed-step mode; use one of {_MIXED_MODES} "
            "('split': decode wrapper + prefill wrapper, 'prefill': prefill wrapper alone)"
        )
    return mode


def prefill_kernels_from_env() -> str:
    """The prefill wrapper's ``backend=`` named by ``PAGEDCORE_FLASHINFER_PREFILL``.

    Raises
    ------
    ValueError
        When the variable holds anything but ``auto``, ``fa2`` or ``fa3``.
    """
    kernels = os.environ.get(PREFILL_KERNELS_ENV, "auto").strip().lower() or "auto"
    if kernels not in _PREFILL_KERNELS:
        raise ValueError(
            f"{PREFILL_KERNELS_ENV}={kernels!r} is not a FlashInfer prefill backend; use one "
            f"of {_PREFILL_KERNELS} ('auto': FlashInfer's pick, FA3 on Hopper)"
        )
    return kernels


@attrs.frozen
class LayerParams:
    """The per-layer arguments of FlashInfer's ``plan()``; layers that agree share a plan."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    window_left: int
    logits_soft_cap: float | None
    sm_scale: float
    q_dtype: torch.dtype
    kv_dtype: torch.dtype


@attrs.frozen(kw_only=True)
class FlashInferMetadata:
    """One step's plan inputs, shared by every layer of a KV-cache group.

    Attributes
    ----------
    num_reqs:
        ``B``.
    num_actual_tokens:
        Real tokens in the step; rows past it are padding and are not computed.
    num_decodes, num_decode_tokens:
        The leading requests (one query token each) run by the decode wrapper; ``0`` when the
        whole step goes through the prefill wrapper.
    decode:
        Page arrays of the decode requests, or None.
    prefill_qo_indptr:
        ``[B_p + 1]`` int32 on the CPU: query offsets of the prefill part, from ``0``.
    prefill:
        Page arrays of the prefill requests, or None.
    causal:
        Bottom-right aligned causal mask.
    generation:
        Which `build` produced this plan (a wrapper planned for another step is re-planned).
    planner:
        The builder owning the wrappers.
    """

    num_reqs: int
    num_actual_tokens: int
    num_decodes: int
    num_decode_tokens: int
    decode: PagedKV | None
    prefill_qo_indptr: torch.Tensor | None
    prefill: PagedKV | None
    causal: bool
    generation: int
    planner: FlashInferMetadataBuilder = attrs.field(repr=False, eq=False)
    #: The decode-graph bucket this capture plan serves (None for an eager step): its
    #: wrappers are FlashInfer's ``use_cuda_graph=True`` ones over the bucket's fixed buffers.
    graph_bucket: int | None = None


class _Wrappers:
    """The decode and prefill wrappers of one `LayerParams`, and which step each is planned for."""

    __slots__ = ("decode", "decode_generation", "prefill", "prefill_generation")

    def __init__(self) -> None:
        self.decode: Any = None
        self.prefill: Any = None
        self.decode_generation = -1
        self.prefill_generation = -1


class FlashInferMetadataBuilder(MetadataBuilder[FlashInferMetadata]):
    """Splits the step and builds FlashInfer's page arrays; owns the wrappers and workspace.

    The workspace buffer and the wrappers are made once per builder (on the first plan) and
    re-planned each step; ``common_prefix_len`` (cascade attention) is accepted and ignored.
    """

    reorder_batch_threshold: ClassVar[int] = 1

    def __init__(
        self, kv_cache_spec: AttentionSpec, layer_names: Sequence[str], device: torch.device
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, device)
        self.mixed_mode = mixed_mode_from_env()
        self.prefill_kernels = prefill_kernels_from_env()
        self._generation = 0
        self._workspace: torch.Tensor | None = None
        self._wrappers: dict[tuple[LayerParams, int | None], _Wrappers] = {}
        #: Per decode-graph bucket: the fixed (indptr, indices, last_page_len) device buffers.
        self._graph_buffers: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._api: fi_api.FlashInferAPI | None = None

    def build(
        self, common: CommonAttentionMetadata, *, common_prefix_len: int = 0
    ) -> FlashInferMetadata:
        """Plan one step's page arrays.

        Raises
        ------
        ValueError
            When the block table has too few columns for the longest sequence.
        """
        block_size = self.kv_cache_spec.block_size
        block_table = common.block_table
        check_table_capacity(block_table, block_size, common.num_reqs, common.max_seq_len)
        num_reqs = common.num_reqs
        query_lens = common.query_lens_cpu[:num_reqs]
        num_decodes = self._num_decodes(common, query_lens)
        seq_lens_cpu = common.seq_lens_cpu[:num_reqs]
        decode = prefill = qo_indptr = None
        if num_decodes > 0:
            decode = paged_kv(block_table, seq_lens_cpu, block_size, 0, num_decodes)
        if num_decodes < num_reqs:
            prefill = paged_kv(block_table, seq_lens_cpu, block_size, num_decodes, num_reqs)
            qo_indptr = torch.zeros(num_reqs - num_decodes + 1, dtype=torch.int32)
            qo_indptr[1:] = torch.cumsum(query_lens[num_decodes:], dim=0)
        self._generation += 1
        return FlashInferMetadata(
            num_reqs=num_reqs,
            num_actual_tokens=common.num_actual_tokens,
            num_decodes=num_decodes,
            num_decode_tokens=num_decodes,
            decode=decode,
            prefill_qo_indptr=qo_indptr,
            prefill=prefill,
            causal=common.causal,
            generation=self._generation,
            planner=self,
        )

    def build_for_cudagraph_capture(self, common: CommonAttentionMetadata) -> FlashInferMetadata:
        """A decode-graph plan: the whole bucket through the tensor-core decode wrapper, whose
        ``use_cuda_graph=True`` instances (one per `LayerParams`) own fixed buffers sized for
        the bucket (``indices`` for ``block_table.shape[1]`` pages per request). The warm-up
        run plans them; `prepare_replay` re-plans them before each replay."""
        bucket = common.num_reqs
        pages = paged_kv(common.block_table, common.seq_lens_cpu[:bucket],
                         self.kv_cache_spec.block_size, 0, bucket)
        if bucket not in self._graph_buffers:
            dev = common.block_table.device
            self._graph_buffers[bucket] = (
                torch.zeros(bucket + 1, dtype=torch.int32, device=dev),
                torch.zeros(bucket * common.block_table.shape[1], dtype=torch.int32, device=dev),
                torch.zeros(bucket, dtype=torch.int32, device=dev),
            )
        self._generation += 1
        return FlashInferMetadata(
            num_reqs=bucket, num_actual_tokens=common.num_actual_tokens, num_decodes=bucket,
            num_decode_tokens=bucket, decode=pages, prefill_qo_indptr=None, prefill=None,
            causal=common.causal, generation=self._generation, planner=self,
            graph_bucket=bucket,
        )

    def prepare_replay(self, metadata: FlashInferMetadata, common: CommonAttentionMetadata) -> None:
        """Re-plan the bucket's graph wrappers for the step about to be replayed: FlashInfer's
        graph-mode ``plan()`` writes the new page arrays into the wrappers' fixed buffers."""
        bucket = metadata.graph_bucket
        if bucket is None:
            return
        pages = paged_kv(common.block_table, common.seq_lens_cpu[:bucket],
                         self.kv_cache_spec.block_size, 0, bucket)
        for (params, key_bucket), wrappers in self._wrappers.items():
            if key_bucket == bucket and wrappers.decode is not None:
                self._plan_decode(wrappers.decode, pages, params)

    def _plan_decode(self, wrapper: Any, pages: PagedKV, params: LayerParams) -> None:
        wrapper.plan(
            pages.indptr, pages.indices, pages.last_page_len, params.num_qo_heads,
            params.num_kv_heads, params.head_dim, self.kv_cache_spec.block_size,
            window_left=params.window_left, logits_soft_cap=params.logits_soft_cap,
            sm_scale=params.sm_scale, q_data_type=params.q_dtype, kv_data_type=params.kv_dtype,
        )

    def _num_decodes(self, common: CommonAttentionMetadata, query_lens: torch.Tensor) -> int:
        """Leading requests of exactly one query token, when the decode wrapper runs them."""
        if self.mixed_mode == "prefill" or common.num_reqs == 0:
            return 0
        try:
            num_decodes = split_decodes_and_prefills(common, decode_threshold=1)[0]
        except ValueError:  # not decode-first: the prefill wrapper takes any order
            return 0
        if num_decodes and int(query_lens[:num_decodes].min()) < 1:
            return 0  # empty requests mixed in: the decode wrapper needs one token each
        return num_decodes

    def planned_wrappers(
        self, metadata: FlashInferMetadata, params: LayerParams
    ) -> tuple[Any, Any]:
        """The ``(decode, prefill)`` wrappers for `params`, planned for `metadata`'s step.

        A part the step does not have is None. Plans only when the wrapper was last planned
        for another step (so once per step per distinct `params`).
        """
        key = (params, metadata.graph_bucket)
        wrappers = self._wrappers.get(key)
        if wrappers is None:
            wrappers = self._wrappers[key] = _Wrappers()
        api = self._load()
        common_kwargs: dict[str, Any] = dict(
            window_left=params.window_left,
            logits_soft_cap=params.logits_soft_cap,
            sm_scale=params.sm_scale,
            q_data_type=params.q_dtype,
            kv_data_type=params.kv_dtype,
        )
        page = self.kv_cache_spec.block_size
        heads = (params.num_qo_heads, params.num_kv_heads, params.head_dim, page)
        decode = prefill = None
        if metadata.decode is not None:
            if wrappers.decode is None:
                graph: dict[str, Any] = {}
                if metadata.graph_bucket is not None:
                    indptr, indices, last = self._graph_buffers[metadata.graph_bucket]
                    graph = dict(use_cuda_graph=True, paged_kv_indptr_buffer=indptr,
                                 paged_kv_indices_buffer=indices,
                                 paged_kv_last_page_len_buffer=last)
                wrappers.decode = api.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace_buffer(), "NHD", use_tensor_cores=True, **graph
                )
            if wrappers.decode_generation != metadata.generation:
                self._plan_decode(wrappers.decode, metadata.decode, params)
                wrappers.decode_generation = metadata.generation
            decode = wrappers.decode
        if metadata.prefill is not None:
            if wrappers.prefill is None:
                wrappers.prefill = api.BatchPrefillWithPagedKVCacheWrapper(
                    self._workspace_buffer(), "NHD", backend=self.prefill_backend(params)
                )
            if wrappers.prefill_generation != metadata.generation:
                p = metadata.prefill
                wrappers.prefill.plan(
                    metadata.prefill_qo_indptr,
                    p.indptr,
                    p.indices,
                    p.last_page_len,
                    *heads,
                    causal=metadata.causal,
                    **common_kwargs,
                )
                wrappers.prefill_generation = metadata.generation
            prefill = wrappers.prefill
        return decode, prefill

    def prefill_backend(self, params: LayerParams) -> str:
        """The prefill wrapper's ``backend=`` for `params`: `prefill_kernels`, except that an
        fp8 cache always runs FA2 (FlashInfer's FA3 kernels take fp8 K/V only with fp8
        queries; FA2 widens fp8 K/V on chip next to 16-bit queries)."""
        return "fa2" if params.kv_dtype.itemsize == 1 else self.prefill_kernels

    def _load(self) -> fi_api.FlashInferAPI:
        if self._api is None:
            self._api = fi_api.load_flashinfer()
        return self._api

    def _workspace_buffer(self) -> torch.Tensor:
        if self._workspace is None:
            self._workspace = workspace(self.device)
        return self._workspace
