"""A CUDA-graph-safe test backend: the reference backend plus a pure-tensor decode path.

`GraphDecodeBackend` declares ``UNIFORM_SINGLE_TOKEN_DECODE``. Its
`build_for_cudagraph_capture` returns metadata that only *holds* the engine's persistent
buffers; its decode forward reads their values at run time with tensor ops only (no host
reads, no value-dependent shapes), so it can be captured by a real CUDA graph and, on the
CPU, replayed eagerly by `EagerCapturer`. Eager steps go through the reference backend.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import attrs
import torch

import pagedcore
from pagedcore.attention.backend import AttentionImpl, CudaGraphSupport, MetadataBuilder
from pagedcore.attention.metadata import CommonAttentionMetadata
from pagedcore.plugins.registry import get_registry
from pagedcore.reference.backend import ReferenceBackend
from pagedcore.reference.impl import ReferenceImpl
from pagedcore.reference.metadata import ReferenceMetadataBuilder

NAME = "graph_decode_test"


@attrs.frozen
class GraphDecodeMetadata:
    """A uniform decode batch over the persistent buffers (values read at run time)."""

    common: CommonAttentionMetadata


class GraphDecodeBuilder(ReferenceMetadataBuilder):
    """Counts the captures it planned."""

    num_capture_builds: ClassVar[int] = 0
    #: Weak references to every capture plan returned.
    plans: ClassVar[list[weakref.ref[GraphDecodeMetadata]]] = []

    def build_for_cudagraph_capture(self, common: CommonAttentionMetadata) -> Any:
        GraphDecodeBuilder.num_capture_builds += 1
        assert common.max_query_len == 1 and common.num_actual_tokens == common.num_reqs
        plan = GraphDecodeMetadata(common)
        GraphDecodeBuilder.plans.append(weakref.ref(plan))
        return plan


@attrs.frozen
class SnapshotGraphMetadata(GraphDecodeMetadata):
    """A capture plan that keeps its own copy of ``seq_lens`` (as a library's graph wrappers
    keep their own page arrays): stale unless `MetadataBuilder.prepare_replay` refreshes it."""

    seq_lens: torch.Tensor


class SnapshotGraphBuilder(GraphDecodeBuilder):
    """Plans capture from a snapshot of the lengths; `prepare_replay` rewrites it in place."""

    num_refreshes: ClassVar[int] = 0

    def build_for_cudagraph_capture(self, common: CommonAttentionMetadata) -> Any:
        plan = super().build_for_cudagraph_capture(common)
        return SnapshotGraphMetadata(plan.common, common.seq_lens.clone())

    def prepare_replay(self, metadata: Any, common: CommonAttentionMetadata) -> None:
        assert isinstance(metadata, SnapshotGraphMetadata)
        n = metadata.seq_lens.shape[0]
        assert common.num_reqs == n and int(common.seq_lens_cpu[:n].min()) >= 1
        metadata.seq_lens.copy_(common.seq_lens[:n])
        SnapshotGraphBuilder.num_refreshes += 1


class GraphDecodeImpl(ReferenceImpl):
    """Decode attention over the whole block table, masked by the live ``seq_lens``; a cache
    write without host syncs (the reference one selects valid slots with a boolean mask)."""

    def do_kv_cache_update(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        slots = slot_mapping[: key.shape[0]]
        valid = (slots >= 0)[:, None, None]
        # Padding rows rewrite slot 0 (the null block's first slot) with its own value.
        index = torch.where(slots >= 0, slots, 0)
        for cache, new in ((kv_cache[0], key), (kv_cache[1], value)):
            flat = cache.view(-1, cache.shape[2], cache.shape[3])
            kept = flat.index_select(0, index)
            flat.index_copy_(0, index, torch.where(valid, new.to(flat.dtype), kept))

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: Any,
        *,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not isinstance(metadata, GraphDecodeMetadata):
            return super().forward(query, key, value, kv_cache, metadata, output=output)
        common = metadata.common
        table = common.block_table.long()  # [B, M]
        pos = torch.arange(table.shape[1] * kv_cache.shape[2], device=query.device)
        seq = (metadata.seq_lens if isinstance(metadata, SnapshotGraphMetadata)
               else common.seq_lens).long()
        visible = pos[None, :] < seq[:, None]
        return attend_rows(self, query, kv_cache, table, seq - 1, visible, output)


def attend_rows(
    impl: AttentionImpl[Any],
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    table: torch.Tensor,
    qpos: torch.Tensor,
    visible: torch.Tensor,
    output: torch.Tensor | None,
) -> torch.Tensor:
    """Attention of query row ``r`` (``[R, Hq, D]``, at position ``qpos[r]``) over the cache
    slots of block-table row ``table[r]`` (``[R, M]`` int64) where ``visible[r]`` (``[R, M *
    block_size]`` bool) holds; the impl's window, soft-cap and ALiBi apply. Pure tensor ops
    (graph-safe); masked keys never reach the sum, and a row with no visible key gives 0."""
    r, m = table.shape
    bs, hkv, d = kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4]
    k = kv_cache[0][table].reshape(r, m * bs, hkv, d).float()
    v = kv_cache[1][table].reshape(r, m * bs, hkv, d).float()
    pos = torch.arange(m * bs, device=query.device)
    if impl.sliding_window is not None:
        visible = visible & ((qpos[:, None] - pos[None, :]) < impl.sliding_window)
    q = query.float().view(r, hkv, impl.num_queries_per_kv, d)
    s = torch.einsum("rhgd,rkhd->rhgk", q, k) * impl.scale
    if impl.logits_soft_cap is not None:
        s = impl.logits_soft_cap * torch.tanh(s / impl.logits_soft_cap)
    slopes = impl.alibi_slopes_on(query.device)
    if slopes is not None:
        rel = (pos[None, :] - qpos[:, None])[:, None, None, :]
        s = s + slopes.view(hkv, -1)[None, :, :, None] * rel
    s = s.masked_fill(~visible[:, None, None, :], float("-inf"))
    p = torch.where(visible.any(-1)[:, None, None, None], s.softmax(-1), 0.0)
    v = torch.where(visible[:, :, None, None], v, 0.0)
    result = torch.einsum("rhgk,rkhd->rhgd", p, v).reshape(r, -1, d).to(query.dtype)
    if output is not None:
        output.copy_(result)
        return output
    return result


class GraphDecodeBackend(ReferenceBackend):
    """The reference backend, declaring single-token-decode CUDA-graph support."""

    name: ClassVar[str] = NAME
    priority: ClassVar[int] = 5000
    cudagraph_support: ClassVar[CudaGraphSupport] = CudaGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE

    @classmethod
    def get_builder_cls(cls) -> type[MetadataBuilder[Any]]:
        return GraphDecodeBuilder

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl[Any]]:
        return GraphDecodeImpl


class SnapshotGraphBackend(GraphDecodeBackend):
    """`GraphDecodeBackend` whose capture plans need `prepare_replay` before each replay."""

    name: ClassVar[str] = "graph_snapshot_test"

    @classmethod
    def get_builder_cls(cls) -> type[MetadataBuilder[Any]]:
        return SnapshotGraphBuilder


@contextmanager
def backend_registered(backend: type[Any], plugin_name: str) -> Iterator[str]:
    """Register `backend` in the process-wide registry inside a block; yields its name."""

    @pagedcore.hookimpl
    def pagedcore_register_backends() -> list[Any]:
        return [backend]

    plugin = types.SimpleNamespace(pagedcore_register_backends=pagedcore_register_backends)
    with get_registry().temporary_plugin(plugin, name=plugin_name):
        yield str(backend.name)


@contextmanager
def graph_backend_registered() -> Iterator[str]:
    """Register `GraphDecodeBackend` in the process-wide registry inside a block."""
    with backend_registered(GraphDecodeBackend, "graph-decode-test") as name:
        yield name
