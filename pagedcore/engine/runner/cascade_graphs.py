"""CUDA graphs for decode steps that cascade: one captured forward per batch-size bucket.

A decode step whose requests share a prefix (a system prompt, the ``n`` samples of one
prompt) reads that prefix once for all of them with cascade attention
(`pagedcore.attention.cascade`). Its plan depends on the shared length ``P``, so without
this module such a step ran eagerly, and on a small model the eager forward costs more
than the reads cascade saves. `CascadeDecodeGraphs` captures, per decode bucket, a forward
whose cascading groups were planned by `MetadataBuilder.build_cascade_for_cudagraph_capture`
with ``P`` a ``[1]`` int32 device scalar per group: before each replay the engine writes the
step's ``P`` into it (``fill_``, no host sync) and calls `MetadataBuilder.prepare_replay`,
which refreshes whatever the plan derives from ``P`` (the triton backend: suffix lengths and
the block table shifted past the prefix). Groups that may not cascade (windowed, MLA, or a
backend without ``supports_cascade_cudagraph``) keep their plain capture plan in the same
graph.

Buckets are captured on first use (the first shared-prefix step of that size), not at
startup: most workloads never cascade, and each capture also builds the prefix partials'
scratch of the bucket.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pagedcore.engine.runner.cuda_graph import DecodeGraphs, GraphCapturer

if TYPE_CHECKING:
    import torch

    from pagedcore.attention.backend import MetadataBuilder
    from pagedcore.attention.metadata import CommonAttentionMetadata

__all__ = ["CascadeDecodeGraphs", "CascadePlans"]


class CascadePlans:
    """What cascade graphs of either kind (decode buckets here, mixed token buckets in
    `pagedcore.engine.runner.cascade_mixed_graphs`) keep besides their graphs: per group
    the ``[1]`` int32 shared-prefix length every replay reads, and each bucket's captured
    plans.

    Parameters
    ----------
    builders:
        One metadata builder per KV-cache group.
    cascading:
        Per group, whether its graph plan cascades.
    device:
        Where the prefix-length scalars live.
    """

    def __init__(self, builders: Sequence[MetadataBuilder[Any]], cascading: Sequence[bool],
                 device: torch.device) -> None:
        import torch

        if len(builders) != len(cascading) or not any(cascading):
            raise ValueError("cascade graphs need one flag per group and a group that cascades")
        self.builders = list(builders)
        self.cascading = tuple(cascading)
        #: Per group, the ``[1]`` int32 shared-prefix length every replay reads.
        self.prefix_lens = [torch.zeros(1, dtype=torch.int32, device=device)
                            for _ in self.builders]
        #: Each bucket's captured plans (one per group), for `prepare_replay`.
        self.plans: dict[int, tuple[Any, ...]] = {}

    def plan(self, bucket: int, common: Sequence[CommonAttentionMetadata]) -> tuple[Any, ...]:
        """Plan `bucket`'s capture over `common` (the buffers filled with padding): cascading
        groups by `MetadataBuilder.build_cascade_for_cudagraph_capture` (capacity: the block
        table's width in tokens), the others by `build_for_cudagraph_capture`."""
        for length in self.prefix_lens:
            length.zero_()  # the warm-up and capture run with nothing shared
        metadata = tuple(
            builder.build_cascade_for_cudagraph_capture(
                c, length, int(c.block_table.shape[1]) * builder.kv_cache_spec.block_size)
            if on else builder.build_for_cudagraph_capture(c)
            for builder, c, length, on in zip(self.builders, common, self.prefix_lens,
                                              self.cascading, strict=True)
        )
        self.plans[bucket] = metadata
        return metadata

    def prepare(self, bucket: int, prefix_lens: Sequence[int],
                common: Sequence[CommonAttentionMetadata]) -> None:
        """Before a replay of `bucket` (its inputs already in the buffers): write each
        cascading group's ``P`` (a non-cascading group's entry must be 0), then
        `MetadataBuilder.prepare_replay` of every group's plan with `common`."""
        for length, p, on in zip(self.prefix_lens, prefix_lens, self.cascading, strict=True):
            if p and not on:
                raise ValueError(f"prefix length {p} for a group whose graph does not cascade")
            if on:
                length.fill_(p)
        for builder, plan, c in zip(self.builders, self.plans[bucket], common, strict=True):
            builder.prepare_replay(plan, c)


class CascadeDecodeGraphs(DecodeGraphs):
    """Decode graphs whose attention cascades over a shared prefix of device length.

    Parameters
    ----------
    sizes, capturer:
        As `DecodeGraphs` (the runner passes its decode buckets).
    builders:
        One metadata builder per KV-cache group.
    cascading:
        Per group, whether its graph plan cascades (the group may cascade and its backend
        declares ``supports_cascade_cudagraph``).
    graph_common:
        ``graph_common(bucket)``: per group, the bucket's metadata over the engine's
        persistent buffers (after they were filled with padding).
    write_padding:
        Fills the persistent buffers with a padding batch of `bucket` requests.
    forward_over:
        ``forward_over(bucket, metadata)``: the zero-argument forward of the base model over
        the persistent buffers with these per-group plans, returning ``[bucket, hidden]``.
    device:
        Where the prefix-length scalars live.
    """

    bucket_unit = "cascade capture"

    def __init__(
        self,
        *,
        sizes: Sequence[int],
        capturer: GraphCapturer,
        builders: Sequence[MetadataBuilder[Any]],
        cascading: Sequence[bool],
        graph_common: Callable[[int], tuple[CommonAttentionMetadata, ...]],
        write_padding: Callable[[int], None],
        forward_over: Callable[[int, tuple[Any, ...]], Callable[[], torch.Tensor]],
        device: torch.device,
    ) -> None:
        self.cascade = CascadePlans(builders, cascading, device)
        self._graph_common = graph_common
        self._write_padding = write_padding
        self._forward_over = forward_over
        #: Replays per bucket (benchmarks and tests read it).
        self.num_replays = 0
        super().__init__(sizes=sizes, capturer=capturer, make_forward=self._make_forward)

    @property
    def cascading(self) -> tuple[bool, ...]:
        """Per group, whether its graph plan cascades."""
        return self.cascade.cascading

    def _make_forward(self, bucket: int) -> Callable[[], torch.Tensor]:
        self._write_padding(bucket)
        return self._forward_over(bucket, self.cascade.plan(bucket, self._graph_common(bucket)))

    def replay_step(
        self, bucket: int, prefix_lens: Sequence[int], common: Sequence[CommonAttentionMetadata]
    ) -> torch.Tensor:
        """Replay `bucket`'s cascade graph for a step whose groups share `prefix_lens` tokens
        (0 for a group that does not cascade this step; a non-cascading group's entry must be
        0). `common` is the step's per-group metadata over the persistent buffers, already
        written. Returns the graph's ``[bucket, hidden]`` output (read it before the next
        replay)."""
        graph = self.capture(bucket)
        self.cascade.prepare(bucket, prefix_lens, common)
        graph.replay()
        self.num_replays += 1
        return graph.output

    def release(self) -> None:
        super().release()
        self.cascade.plans.clear()
