"""Which CUDA graph serves a step, and the graphs' lifecycle (`ModelRunner`'s graph half).

`GraphRouting` is mixed into `pagedcore.engine.runner.model_runner.ModelRunner`: it enables
and releases the decode, mixed-step and cascade graphs, captures the cascade kinds lazily (a
failed capture turns that kind off with a warning), picks per step the graph that replays it
(`route_step`, during `prepare`: a cascade graph first, then a mixed cascade graph, else the plain
graph or, when cascade's saved reads outweigh the lost replay, an eager cascade), replays it
(`replay_graph`, during `execute`), and names why a step ran eagerly (`STEP_PATHS`).
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pagedcore.engine.runner.cascade_graphs import CascadeDecodeGraphs
from pagedcore.engine.runner.cascade_mixed_graphs import CascadeMixedGraphs
from pagedcore.engine.runner.cuda_graph import (
    DecodeGraphs,
    GraphCapturer,
    capture_sizes,
    cudagraph_unsupported_reason,
)
from pagedcore.engine.runner.mixed_graphs import (
    MixedGraphs,
    enable_mixed_graphs,
    mixed_forward_over,
)
from pagedcore.engine.runner.prompt_rows import prompt_rows_wanted
from pagedcore.engine.scheduling.scheduler_types import DecodeBatch

if TYPE_CHECKING:
    import torch

    from pagedcore.attention.backend import AttentionBackend, MetadataBuilder
    from pagedcore.engine.models.attention_hook import LayerBinding, StepContext
    from pagedcore.engine.runner.cascade_plan import CascadePlanner
    from pagedcore.engine.runner.input_batch import InputBatch, StepInputs
    from pagedcore.engine.scheduling.scheduler import ScheduledRequest

__all__ = ["STEP_PATHS", "GraphRouting"]

#: How a step can run (`ModelRunner.step_paths` keys): a replayed decode, cascade-decode or
#: mixed-step graph, or eagerly because cascade attention planned it from the step's own
#: lengths, graphs are off (CPU, ``enforce_eager``, a backend without graph support), only
#: decode graphs exist and the step is not a decode batch they hold, a layer's fp8 scales
#: wait for the first prefill, or the step has more tokens or requests than the largest bucket.
STEP_PATHS = (
    "decode graph", "cascade graph", "mixed graph", "cascade mixed graph",
    "eager (cascade plan)", "eager (graphs off)",
    "eager (no mixed-step graphs)", "eager (fp8 scales pending)", "eager (no bucket fits)",
)


class GraphRouting:
    """The CUDA-graph half of `ModelRunner` (a mixin: it reads the runner's backends,
    builders, input batch and cascade planner, and calls its forward builders)."""

    # Set by `ModelRunner.__init__`.
    backends: list[type[AttentionBackend]]
    builders: list[MetadataBuilder[Any]]
    cascade: CascadePlanner
    input_batch: InputBatch
    device: torch.device
    max_num_seqs: int
    max_num_batched_tokens: int
    layers: dict[int, LayerBinding]
    mixed_graphs: MixedGraphs | None
    mixed_graphs_disabled_reason: str | None
    graphs: DecodeGraphs | None
    _graph_plans: dict[int, tuple[Any, ...]]
    cudagraph_disabled_reason: str | None
    cascade_graphs: CascadeDecodeGraphs | None
    cascade_mixed_graphs: CascadeMixedGraphs | None
    _graph_fallback: bool
    step_paths: Counter[str]

    if TYPE_CHECKING:  # provided by ModelRunner
        def _hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
                    ctx: StepContext) -> torch.Tensor: ...

        def _graph_forward(self, bucket: int) -> Callable[[], torch.Tensor]: ...

        def _forward_over(self, bucket: int,
                          metadata: tuple[Any, ...]) -> Callable[[], torch.Tensor]: ...

        def _kv_scales_pending(self) -> bool: ...

    def enable_cudagraphs(
        self,
        *,
        sizes: Sequence[int] | None = None,
        capturer: GraphCapturer | None = None,
        capture_now: bool = True,
        fallback: bool = True,
    ) -> str | None:
        """Run uniform single-token decode steps as CUDA graphs, one per batch-size bucket.

        Parameters
        ----------
        sizes:
            Buckets (None: `capture_sizes` of ``max_num_seqs``); larger batches run eagerly.
        capturer:
            None: `CudaGraphCapturer` when the device is CUDA and every group's backend
            declares ``cudagraph_support >= UNIFORM_SINGLE_TOKEN_DECODE``. A given capturer
            (tests: `EagerCapturer`) skips those checks.
        capture_now:
            Capture every bucket now (largest first) instead of on first use.
        fallback:
            When a capture fails: serve eagerly with a warning (True), or raise (False: with
            tensor parallelism every rank must capture the same graphs, or their collectives
            stop meeting).

        Returns
        -------
        str or None
            Why graphs stay off (None: enabled); also kept in ``cudagraph_disabled_reason``.
        """
        automatic = capturer is None
        if capturer is None:
            reason = cudagraph_unsupported_reason(self.backends, self.device)
            if reason is not None:
                self.cudagraph_disabled_reason = reason
                return reason
            from pagedcore.engine.runner.cuda_graph import CudaGraphCapturer

            capturer = CudaGraphCapturer(self.device)
        limit = self.max_num_seqs
        chosen = [s for s in (capture_sizes(limit) if sizes is None else sizes) if s <= limit]
        if not chosen:
            raise ValueError(f"no capture size in {sizes} is <= max_num_seqs={limit}")
        self.graphs = DecodeGraphs(
            sizes=chosen, capturer=capturer, make_forward=self._graph_forward
        )
        self._graph_fallback = fallback
        cascading = [ok and b.supports_cascade_cudagraph
                     for ok, b in zip(self.cascade.eligible, self.backends, strict=True)]
        if any(cascading):
            self.cascade_graphs = CascadeDecodeGraphs(
                sizes=chosen, capturer=capturer, builders=self.builders, cascading=cascading,
                graph_common=self.input_batch.graph_common,
                write_padding=self.input_batch.write_padding,
                forward_over=self._forward_over, device=self.device,
            )
        self.cudagraph_disabled_reason = None
        # Mixed steps too, when every backend declares ALWAYS (captured first: the largest
        # graphs, whose pool memory the decode graphs then reuse).
        self.mixed_graphs, self.mixed_graphs_disabled_reason = enable_mixed_graphs(
            self, capturer=capturer, capture_now=capture_now, check_device=automatic,
            strict=not (automatic and fallback),
        )
        self._enable_cascade_mixed_graphs(capturer, cascading)
        if capture_now:
            try:
                self.graphs.capture_all()
            except Exception as exc:
                if not (automatic and fallback):
                    raise
                # A backend that declares support but cannot be captured: serve eagerly
                # (slower, still correct) and say why.
                self.graphs = None
                self.cascade_graphs = None
                self.cudagraph_disabled_reason = (
                    f"capture failed: {type(exc).__name__}: {exc}"[:500]
                )
                warnings.warn(
                    f"CUDA graphs disabled, decode steps run eagerly: "
                    f"{self.cudagraph_disabled_reason}",
                    RuntimeWarning,
                    stacklevel=2,
                )
                return self.cudagraph_disabled_reason
        return None

    def _enable_cascade_mixed_graphs(self, capturer: GraphCapturer,
                                     cascading: Sequence[bool]) -> None:
        """Set up (not capture) cascade mixed-step graphs over the mixed graphs' buffers for
        the groups whose decode graphs cascade and whose backend declares
        ``supports_cascade_mixed_cudagraph``."""
        mixed = self.mixed_graphs
        flags = [on and b.supports_cascade_mixed_cudagraph
                 for on, b in zip(cascading, self.backends, strict=True)]
        self.cascade_mixed_graphs = None
        if mixed is None or not any(flags):
            return
        buffers = mixed.buffers

        def forward_over(bucket: int, metadata: tuple[Any, ...]) -> Callable[[], torch.Tensor]:
            return mixed_forward_over(self, buffers, bucket, metadata)

        self.cascade_mixed_graphs = CascadeMixedGraphs(
            sizes=mixed.sizes, buffers=buffers, capturer=capturer, builders=self.builders,
            cascading=flags, forward_over=forward_over, device=self.device,
        )

    def release_graphs(self) -> None:
        """Free the captured decode and mixed-step graphs (steps run eagerly afterwards)."""
        for graphs in (self.graphs, self.mixed_graphs, self.cascade_graphs,
                       self.cascade_mixed_graphs):
            if graphs is not None:
                graphs.release()
        if self.graphs is not None or self.mixed_graphs is not None:
            self.cudagraph_disabled_reason = "graphs released"
            self.mixed_graphs_disabled_reason = "graphs released"
        self.graphs = None
        self.mixed_graphs = None
        self.cascade_graphs = None
        self.cascade_mixed_graphs = None
        self._graph_plans.clear()


    def route_step(
        self, scheduled: Sequence[ScheduledRequest], use: tuple[int, ...], decode_graph: bool
    ) -> tuple[int | None, tuple[int, ...]]:
        """The decode bucket this step is padded to (None: not a decode or cascade graph
        step) and the per-group prefix lengths it cascades with, given the planner's `use`.

        A cascade decode graph serves the step first (captured now, on first use: a capture
        fills the buffers with padding), then a mixed cascade graph; otherwise, when a plain
        graph would replay the step, it cascades eagerly only if `CascadePlanner.against_graph`
        says the saved reads outweigh the lost replay. A plain decode bucket is captured here
        too."""
        cascade_bucket = None
        if any(use):
            cascade_bucket, graph_use = self._cascade_graph_bucket(scheduled, use, decode_graph)
            if cascade_bucket is not None and not self._capture_cascade_graph(cascade_bucket):
                cascade_bucket = None
            mixed_use = (None if cascade_bucket is not None
                         else self._mixed_cascade_use(scheduled, use, decode_graph))
            if cascade_bucket is not None:
                use = graph_use  # the step replays its bucket's cascade graph
            elif mixed_use is not None:
                use = mixed_use  # the step replays its token bucket's mixed cascade graph
            elif self._graph_would_serve(scheduled, decode_graph):
                # An eager cascade plan follows this step's lengths: cascade only when the
                # reads it saves outweigh the lost replay.
                use = self.cascade.against_graph(use, len(scheduled))
        if cascade_bucket is not None:
            return cascade_bucket, use
        bucket = None if any(use) or not decode_graph else self._graph_bucket(scheduled)
        if bucket is not None:
            assert self.graphs is not None
            self.graphs.capture(bucket)
        return bucket, use

    def replay_graph(self, inputs: StepInputs) -> torch.Tensor | None:
        """Replay the graph that serves this prepared step and return its ``[T, hidden]``
        hidden states (counted in `step_paths`), or None when the step runs eagerly."""
        if inputs.cudagraph_bucket is not None:
            assert self.graphs is not None
            bucket = inputs.cudagraph_bucket
            if any(inputs.cascade_prefix_lens):
                assert self.cascade_graphs is not None
                self.step_paths["cascade graph"] += 1
                return self.cascade_graphs.replay_step(
                    bucket, inputs.cascade_prefix_lens, inputs.common)
            self.step_paths["decode graph"] += 1
            self.graphs.capture(bucket)
            for builder, plan, common in zip(
                self.builders, self._graph_plans[bucket], inputs.common, strict=True
            ):
                builder.prepare_replay(plan, common)
            return self.graphs.replay(bucket)
        if self._cascade_mixed_ready(inputs):
            assert self.cascade_mixed_graphs is not None
            self.step_paths["cascade mixed graph"] += 1
            return self.cascade_mixed_graphs.run(inputs)
        if (
            not any(inputs.cascade_prefix_lens)
            and self.mixed_graphs is not None
            and not self._kv_scales_pending()  # a replay runs no calibration (Python)
            and self.mixed_graphs.bucket_for(inputs)
        ):
            self.step_paths["mixed graph"] += 1
            return self.mixed_graphs.run(inputs)
        self.step_paths[self._eager_path(inputs)] += 1
        return None

    def _graph_bucket(self, scheduled: Sequence[ScheduledRequest]) -> int | None:
        if self.graphs is None or not scheduled:
            return None
        n = len(scheduled)
        if not isinstance(scheduled, DecodeBatch) and (
            [s.num_new_tokens for s in scheduled].count(1) != n
            # A one-token prompt chunk whose logits give a prompt logprob: the eager path
            # (`pagedcore.engine.distributed.plan.StepPlan.decode_graph` tells TP workers).
            or prompt_rows_wanted(scheduled)
        ):
            return None
        return self.graphs.bucket_for(n)

    def _capture_lazily(self, attr: str, bucket: int, kind: str, steps: str) -> bool:
        """Capture `bucket` of the cascade graphs in ``self.<attr>`` if not yet done. A
        capture that fails turns that kind off with a warning naming `kind` and what its
        `steps` do instead, unless graphs were enabled with ``fallback=False`` (tensor
        parallelism), which raises."""
        graphs = getattr(self, attr)
        assert graphs is not None
        try:
            graphs.capture(bucket)
        except Exception as exc:
            if not self._graph_fallback:
                raise
            graphs.release()
            setattr(self, attr, None)
            warnings.warn(
                f"{kind} disabled (capture of {graphs.bucket_unit} {bucket} failed: "
                f"{type(exc).__name__}: {exc}"[:400] + f"); {steps} replay the plain graph "
                "or cascade eagerly",
                RuntimeWarning, stacklevel=3,
            )
            return False
        return True

    def _capture_cascade_graph(self, bucket: int) -> bool:
        """Capture `bucket`'s cascade graph if not yet done (before the step's inputs land:
        a capture fills the buffers with padding); a failure turns cascade decode graphs off
        (shared-prefix decode steps then follow `against_graph`), see `_capture_lazily`."""
        return self._capture_lazily("cascade_graphs", bucket, "cascade decode graphs",
                                    "shared-prefix decode steps")

    def _cascade_graph_bucket(
        self, scheduled: Sequence[ScheduledRequest], use: tuple[int, ...], decode_graph: bool
    ) -> tuple[int | None, tuple[int, ...]]:
        """The decode bucket whose cascade graph serves this step, and the per-group prefix
        lengths it replays with (groups whose graph plan does not cascade get 0); ``(None,
        use)`` when no cascade graph applies (mixed steps, no decode graph, no group left
        cascading)."""
        graphs = self.cascade_graphs
        if graphs is None or not decode_graph:
            return None, use
        bucket = self._graph_bucket(scheduled)
        graph_use = tuple(p if on else 0 for p, on in zip(use, graphs.cascading, strict=True))
        if bucket is None or not any(graph_use):
            return None, use
        return bucket, graph_use

    def _capture_cascade_mixed(self, bucket: int) -> bool:
        """Capture `bucket`'s mixed cascade graph if not yet done; a failure turns mixed
        cascade graphs off (the step then cascades eagerly; later shared-prefix mixed steps
        follow `against_graph`), see `_capture_lazily`."""
        return self._capture_lazily("cascade_mixed_graphs", bucket,
                                    "cascade mixed-step graphs", "shared-prefix mixed steps")

    def _cascade_mixed_ready(self, inputs: StepInputs) -> bool:
        """A mixed cascade graph serves this prepared step, its bucket captured (now, on
        first use: the mixed buffers are loaded after the capture's padding)."""
        graphs = self.cascade_mixed_graphs
        bucket = None if graphs is None else graphs.cascade_bucket(inputs)
        # (cheapest check first: most steps cascade nothing)
        return (bucket is not None and not self._kv_scales_pending()
                and self._capture_cascade_mixed(bucket))

    def _mixed_graph_fits(self, scheduled: Sequence[ScheduledRequest]) -> bool:
        """A mixed-step graph's token bucket and request slots hold this step."""
        mixed = self.mixed_graphs
        if mixed is None or self._kv_scales_pending():
            return False
        tokens = (len(scheduled) if isinstance(scheduled, DecodeBatch)
                  else sum(s.num_new_tokens for s in scheduled))
        return 0 < tokens <= max(mixed.sizes) and len(scheduled) <= mixed.buffers.num_reqs

    def _graph_would_serve(self, scheduled: Sequence[ScheduledRequest],
                           decode_graph: bool) -> bool:
        """A decode or mixed-step graph would replay this step if it did not cascade."""
        if decode_graph and self._graph_bucket(scheduled) is not None:
            return True
        return self._mixed_graph_fits(scheduled)

    def _mixed_cascade_use(
        self, scheduled: Sequence[ScheduledRequest], use: tuple[int, ...], decode_graph: bool
    ) -> tuple[int, ...] | None:
        """The per-group prefix lengths a mixed cascade graph replays this step with (groups
        whose plan does not cascade get 0), or None when none serves it (no such graphs, a
        step a decode graph holds, no bucket fits, no group left cascading)."""
        graphs = self.cascade_mixed_graphs
        if graphs is None or (decode_graph and self._graph_bucket(scheduled) is not None):
            return None
        graph_use = tuple(p if on else 0 for p, on in zip(use, graphs.cascading, strict=True))
        if not any(graph_use) or not self._mixed_graph_fits(scheduled):
            return None
        return graph_use

    def _eager_path(self, inputs: StepInputs) -> str:
        """Why a step runs eagerly, as one of `STEP_PATHS`' ``eager (...)`` entries."""
        if any(inputs.cascade_prefix_lens):
            return "eager (cascade plan)"
        if self.mixed_graphs is None:
            return "eager (graphs off)" if self.graphs is None else "eager (no mixed-step graphs)"
        if self._kv_scales_pending():
            return "eager (fp8 scales pending)"
        return "eager (no bucket fits)"
