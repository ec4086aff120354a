"""Backends for the graph-plan cases (`pagedcore.conformance.graphs`): one that keeps the
CUDA-graph planning contract, and planted ones that each break it the classic way.

* `GraphSafeReference`: the reference backend declaring decode and cascade graphs, whose
  capture plans only *hold* the engine's buffers and plan from their live device values at
  run time (a host copy of them: fine on the CPU, where this double runs; a real CUDA graph
  needs tensor-only code, as tests/engine/graph_backend.py has).
* `SnapshotsSeqLens`: (a) its capture plan copies ``seq_lens`` at build time and keeps that
  copy (a library's graph wrapper with a preallocated length buffer, never refreshed).
* `PlansOnTheHostAtCapture`: (a') the reference declaring decode graphs without overriding
  `build_for_cudagraph_capture`: the default calls `build`, which reads the host lengths and
  computes every slot then.
* `ReadsHostLengthsInForward`: the forward plans from ``seq_lens_cpu``: right eagerly, wrong
  in a graph (a replay runs no Python; the host values were frozen at capture).
* `CaptureRaises`: its cascade capture raises.
* `triton_without_cascade_refresh()`: (b) the triton backend whose `prepare_replay` does
  nothing, so its cascade graph plan keeps the suffix lengths and the shifted block table
  of the capture step.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import torch

from pagedcore.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    CudaGraphSupport,
    MetadataBuilder,
)
from pagedcore.attention.metadata import CommonAttentionMetadata
from pagedcore.reference import ReferenceBackend
from pagedcore.reference.impl import ReferenceImpl
from pagedcore.reference.metadata import ReferenceMetadata, ReferenceMetadataBuilder

DECODE_GRAPHS = CudaGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE


@attrs.frozen(eq=False)
class LivePlan:
    """A capture plan over the engine's buffers: the reference plan is made at run time.

    `seq_lens` (when set) replaces ``common.seq_lens``; `host` plans from the host copies
    instead of the device buffers."""

    common: CommonAttentionMetadata
    builder: ReferenceMetadataBuilder
    prefix_len: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    host: bool = False

    def now(self) -> ReferenceMetadata:
        """The reference plan of the buffers' current values (the plain one: the reference
        is what a cascade must equal, whatever ``prefix_len`` holds)."""
        c = self.common
        if self.host:
            return self.builder.build(c)
        lens = c.seq_lens if self.seq_lens is None else self.seq_lens
        return self.builder.build(attrs.evolve(
            c, seq_lens_cpu=lens.cpu(), query_start_loc_cpu=c.query_start_loc.cpu()))


class LiveGraphBuilder(ReferenceMetadataBuilder):
    """Capture plans that hold the buffers (`LivePlan`)."""

    def build_for_cudagraph_capture(self, common: CommonAttentionMetadata) -> Any:
        return LivePlan(common, self)

    def build_cascade_for_cudagraph_capture(
        self, common: CommonAttentionMetadata, prefix_len: torch.Tensor, capacity: int
    ) -> Any:
        assert capacity == common.block_table.shape[1] * self.block_size
        return LivePlan(common, self, prefix_len)


class LiveGraphImpl(ReferenceImpl):
    """The reference impl; a `LivePlan` is planned when the forward runs."""

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: torch.Tensor, metadata: Any, *, output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if isinstance(metadata, LivePlan):
            metadata = metadata.now()
        return super().forward(query, key, value, kv_cache, metadata, output=output)


def _backend(
    name: str, builder: type[MetadataBuilder[Any]], *, cascade: bool = True,
    impl: type[AttentionImpl[Any]] = LiveGraphImpl,
) -> type[AttentionBackend]:
    def get_builder_cls(cls: type[AttentionBackend]) -> type[MetadataBuilder[Any]]:
        return builder

    def get_impl_cls(cls: type[AttentionBackend]) -> type[AttentionImpl[Any]]:
        return impl

    return type(name, (ReferenceBackend,), {
        "name": name,
        "cudagraph_support": DECODE_GRAPHS,
        "supports_cascade_cudagraph": cascade,
        "get_builder_cls": classmethod(get_builder_cls),
        "get_impl_cls": classmethod(get_impl_cls),
    })


class _SnapshotBuilder(LiveGraphBuilder):
    def build_for_cudagraph_capture(self, common: CommonAttentionMetadata) -> Any:
        return LivePlan(common, self, seq_lens=common.seq_lens.clone())


class _HostInForwardBuilder(LiveGraphBuilder):
    def build_for_cudagraph_capture(self, common: CommonAttentionMetadata) -> Any:
        return LivePlan(common, self, host=True)


class _RaisingCascadeBuilder(LiveGraphBuilder):
    def build_cascade_for_cudagraph_capture(
        self, common: CommonAttentionMetadata, prefix_len: torch.Tensor, capacity: int
    ) -> Any:
        raise RuntimeError("planted: cannot plan this cascade")


GraphSafeReference = _backend("graph_safe_reference", LiveGraphBuilder)
SnapshotsSeqLens = _backend("snapshots_seq_lens", _SnapshotBuilder, cascade=False)
PlansOnTheHostAtCapture = _backend("plans_on_the_host_at_capture", ReferenceMetadataBuilder,
                                   cascade=False, impl=ReferenceImpl)
ReadsHostLengthsInForward = _backend("reads_host_lengths_in_forward", _HostInForwardBuilder,
                                     cascade=False)
CaptureRaises = _backend("cascade_capture_raises", _RaisingCascadeBuilder)

#: Planted decode-graph bugs: each fails ``graph/decode/...``.
BROKEN_DECODE: dict[str, type[AttentionBackend]] = {
    "snapshots_seq_lens": SnapshotsSeqLens,
    "plans_on_the_host_at_capture": PlansOnTheHostAtCapture,
    "reads_host_lengths_in_forward": ReadsHostLengthsInForward,
}


def triton_without_cascade_refresh() -> type[AttentionBackend]:
    """(b) The triton backend with a `prepare_replay` that does nothing (imports triton:
    set ``TRITON_INTERPRET=1`` first on a machine without a GPU)."""
    from pagedcore_triton import TritonAttentionBackend, TritonMetadataBuilder

    class StaleCascadeBuilder(TritonMetadataBuilder):
        def prepare_replay(self, metadata: Any, common: CommonAttentionMetadata) -> None:
            pass  # planted: the suffix buffers keep what the capture step derived

    class StaleCascadeTriton(TritonAttentionBackend):
        name: ClassVar[str] = "triton_stale_cascade"

        @classmethod
        def get_builder_cls(cls) -> type[MetadataBuilder[Any]]:
            return StaleCascadeBuilder

    return StaleCascadeTriton
