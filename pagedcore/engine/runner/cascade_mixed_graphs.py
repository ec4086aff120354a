"""CUDA graphs for mixed steps that cascade: one captured forward per token bucket.

A mixed step (new prompts or prompt chunks beside decodes) whose requests share a prefix
(a system prompt, a batch of requests for one document) could either replay its plain
mixed-step graph, reading the prefix once per request, or cascade eagerly
(`pagedcore.attention.cascade`) and pay the eager forward; the engine kept the graph unless
the saved reads outweighed the eager step (`pagedcore.attention.cascade.cascade_beats_graph`).
`CascadeMixedGraphs` removes that choice for backends declaring
``supports_cascade_mixed_cudagraph``: per token bucket it captures a forward whose cascading
groups were planned by `MetadataBuilder.build_cascade_for_cudagraph_capture` on the mixed
bucket, with the shared length ``P`` a ``[1]`` int32 device scalar per group. A replay loads
the step into the mixed graphs' persistent buffers (`MixedBuffers`, shared with the plain
mixed graphs), writes ``P`` (``fill_``), calls `MetadataBuilder.prepare_replay` and replays.
Groups that may not cascade keep their plain mixed capture plan in the same graph.

Buckets are captured on first use, as cascade decode graphs are (`cascade_graphs`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from pagedcore.engine.runner.cascade_graphs import CascadePlans
from pagedcore.engine.runner.mixed_graphs import MixedBuffers, MixedGraphs

if TYPE_CHECKING:
    import torch

    from pagedcore.attention.backend import MetadataBuilder
    from pagedcore.attention.metadata import CommonAttentionMetadata
    from pagedcore.engine.runner.cuda_graph import GraphCapturer
    from pagedcore.engine.runner.input_batch import StepInputs

__all__ = ["CascadeMixedGraphs", "replay_common"]


def replay_common(
    capture_common: Sequence[CommonAttentionMetadata], inputs: StepInputs
) -> tuple[CommonAttentionMetadata, ...]:
    """Per group, a bucket's capture metadata (over the mixed buffers, now holding `inputs`
    after `MixedBuffers.load`) with the host arrays of the loaded step: the real requests'
    ``query_start_loc`` and ``seq_lens``, then padding requests (query length 0,
    ``seq_lens`` 0). What `MetadataBuilder.prepare_replay` receives."""
    import torch

    first = inputs.common[0]
    slots = capture_common[0].num_reqs
    n, t = first.num_reqs, inputs.num_tokens
    qsl = torch.full((slots + 1,), t, dtype=torch.int32)
    qsl[: n + 1] = first.query_start_loc_cpu[: n + 1]
    seq = torch.zeros(slots, dtype=torch.int32)
    seq[:n] = first.seq_lens_cpu[:n]
    return tuple(attrs.evolve(c, query_start_loc_cpu=qsl, seq_lens_cpu=seq)
                 for c in capture_common)


class CascadeMixedGraphs(MixedGraphs):
    """Mixed-step graphs whose attention cascades over a shared prefix of device length.

    Parameters
    ----------
    sizes, buffers, capturer:
        As `MixedGraphs` (the runner passes its mixed graphs' token buckets and buffers).
    builders:
        One metadata builder per KV-cache group.
    cascading:
        Per group, whether its graph plan cascades (the group may cascade and its backend
        declares ``supports_cascade_mixed_cudagraph``).
    forward_over:
        ``forward_over(bucket, metadata)``: the zero-argument forward of the base model
        over the first `bucket` token slots of `buffers` with these per-group plans,
        returning ``[bucket, hidden]`` (`mixed_graphs.mixed_forward_over`).
    device:
        Where the prefix-length scalars live.
    """

    bucket_unit = "mixed cascade capture"

    def __init__(
        self,
        *,
        sizes: Sequence[int],
        buffers: MixedBuffers,
        capturer: GraphCapturer,
        builders: Sequence[MetadataBuilder[Any]],
        cascading: Sequence[bool],
        forward_over: Callable[[int, tuple[Any, ...]], Callable[[], torch.Tensor]],
        device: torch.device,
    ) -> None:
        self.cascade = CascadePlans(builders, cascading, device)
        self._forward_over = forward_over
        #: Each captured bucket's metadata over the buffers (`replay_common` fills in the
        #: host arrays per replay).
        self._capture_common: dict[int, tuple[CommonAttentionMetadata, ...]] = {}
        super().__init__(sizes=sizes, buffers=buffers, capturer=capturer,
                         make_forward=self._make_forward)

    @property
    def cascading(self) -> tuple[bool, ...]:
        """Per group, whether its graph plan cascades."""
        return self.cascade.cascading

    def _make_forward(self, bucket: int) -> Callable[[], torch.Tensor]:
        common = self.buffers.common(bucket)
        self._capture_common[bucket] = common
        return self._forward_over(bucket, self.cascade.plan(bucket, common))

    def cascade_bucket(self, inputs: StepInputs) -> int | None:
        """The token bucket whose graph serves `inputs` with its cascade request, or None
        (nothing to cascade, a group asked to cascade whose plan does not, or no bucket
        holds the step)."""
        prefix = inputs.cascade_prefix_lens
        if not any(prefix) or any(p and not on for p, on in zip(prefix, self.cascading,
                                                                  strict=True)):
            return None
        return self.bucket_for(inputs)

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Serve a cascading mixed step by a replay: ``[bucket, hidden]`` hidden states, the
        step's rows first (the graph's persistent output: read it before the next replay).
        ``inputs.cascade_prefix_lens`` gives each group's ``P`` (0: not cascading)."""
        bucket = self.cascade_bucket(inputs)
        if bucket is None:
            raise ValueError(
                f"no mixed cascade graph serves this step ({inputs.num_tokens} tokens, "
                f"prefix lengths {inputs.cascade_prefix_lens}; buckets {self.sizes}, "
                f"cascading groups {self.cascading}); run it eagerly"
            )
        graph = self.capture(bucket)
        self.buffers.load(inputs, bucket)
        self.cascade.prepare(bucket, inputs.cascade_prefix_lens,
                             replay_common(self._capture_common[bucket], inputs))
        graph.replay()
        self.num_replays += 1
        return graph.output

    def release(self) -> None:
        super().release()
        self.cascade.plans.clear()
        self._capture_common.clear()
