"""A test backend safe to capture for mixed steps: `GraphMixedBackend` declares ``ALWAYS``.

Its capture plans only *hold* the engine's persistent buffers; the mixed forward reads their
values at run time with tensor ops only (no host reads, no value-dependent shapes): each
token finds its request with ``searchsorted`` over ``query_start_loc``, gathers its request's
whole block-table row and masks by position. Padding tokens (past the last real one) and
padding requests (query length 0, ``seq_lens`` 0) produce zeros. Eager steps go through the
reference backend, decode captures through `GraphDecodeImpl`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import attrs
import torch
from graph_backend import (
    GraphDecodeBackend,
    GraphDecodeBuilder,
    GraphDecodeImpl,
    attend_rows,
    backend_registered,
)

from pagedcore.attention.backend import AttentionImpl, CudaGraphSupport, MetadataBuilder
from pagedcore.attention.metadata import CommonAttentionMetadata

NAME = "graph_mixed_test"


@attrs.frozen
class GraphMixedMetadata:
    """A mixed token bucket over the persistent buffers (values read at run time)."""

    common: CommonAttentionMetadata


class GraphMixedBuilder(GraphDecodeBuilder):
    """Mixed buckets get `GraphMixedMetadata`; decode captures as in `GraphDecodeBuilder`."""

    num_mixed_builds: ClassVar[int] = 0

    def build_for_cudagraph_capture(self, common: CommonAttentionMetadata) -> Any:
        if common.max_query_len == 1:
            return super().build_for_cudagraph_capture(common)
        assert common.max_query_len == common.num_actual_tokens
        GraphMixedBuilder.num_mixed_builds += 1
        return GraphMixedMetadata(common)


class GraphMixedImpl(GraphDecodeImpl):
    """Mixed-step attention from the live buffers (pure tensor ops)."""

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
        if not isinstance(metadata, GraphMixedMetadata):
            return super().forward(query, key, value, kv_cache, metadata, output=output)
        common = metadata.common
        qsl = common.query_start_loc.long()
        seq = common.seq_lens.long()
        tok = torch.arange(query.shape[0], device=query.device)
        real = tok < qsl[-1]
        req = torch.searchsorted(qsl[1:], tok, right=True).clamp(max=seq.shape[0] - 1)
        q_len = qsl[req + 1] - qsl[req]
        pos_q = seq[req] - q_len + (tok - qsl[req])
        table = common.block_table.long()[req]  # [T, M]
        pos = torch.arange(table.shape[1] * kv_cache.shape[2], device=query.device)
        visible = (pos[None, :] <= pos_q[:, None]) & real[:, None]
        return attend_rows(self, query, kv_cache, table, pos_q, visible, output)


class GraphMixedBackend(GraphDecodeBackend):
    """The reference backend, declaring full (mixed-step) CUDA-graph support."""

    name: ClassVar[str] = NAME
    priority: ClassVar[int] = 5001
    cudagraph_support: ClassVar[CudaGraphSupport] = CudaGraphSupport.ALWAYS

    @classmethod
    def get_builder_cls(cls) -> type[MetadataBuilder[Any]]:
        return GraphMixedBuilder

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl[Any]]:
        return GraphMixedImpl


@contextmanager
def mixed_backend_registered() -> Iterator[str]:
    """Register `GraphMixedBackend` in the process-wide registry inside a block."""
    with backend_registered(GraphMixedBackend, "graph-mixed-test") as name:
        yield name
