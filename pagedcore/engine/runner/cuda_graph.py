"""CUDA graphs for uniform single-token decode steps.

A decode step of a 0.5B model is dominated by the Python and launch overhead of its eager
layers. `DecodeGraphs` captures the base model's forward once per batch-size bucket (1, 2, 4,
8, 16, 24, ... like vLLM's capture sizes) over the engine's persistent input buffers; a step
whose every request has one query token is padded to the smallest bucket that holds it, its
inputs are rewritten *in place* into those buffers, and the bucket's graph is replayed.

Padding requests have ``seq_len`` 1, a block-table row of zeros (the null block),
``slot_mapping`` -1, input id 0 and position 0; their hidden states are discarded (logits are
computed after the replay for the real rows only).

Graphs are used only when the device is CUDA and every KV-cache group's backend declares
``cudagraph_support >= UNIFORM_SINGLE_TOKEN_DECODE`` (see `cudagraph_unsupported_reason`).
The capture mechanism is a `GraphCapturer`: `CudaGraphCapturer` on a GPU, `EagerCapturer`
(records the callable and replays it eagerly on the same buffers) in CPU tests.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs

if TYPE_CHECKING:
    import torch

    from pagedcore.attention.backend import AttentionBackend, CudaGraphSupport

__all__ = [
    "BucketedGraphs",
    "CapturedGraph",
    "CudaGraphCapturer",
    "DecodeGraphs",
    "EagerCapturer",
    "GraphCapturer",
    "capture_sizes",
    "cudagraph_unsupported_reason",
    "graph_support_reason",
    "pick_bucket",
]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch-size buckets for `max_num_seqs`: 1, 2, 4, then every multiple of 8, then
    `max_num_seqs` itself (when not already one), ascending.

    Examples
    --------
    >>> capture_sizes(20)
    [1, 2, 4, 8, 16, 20]
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be a positive integer, got {max_num_seqs}")
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs]
    sizes += list(range(8, max_num_seqs + 1, 8))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def pick_bucket(num_reqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest of the ascending `sizes` that holds `num_reqs` requests (None: none does)."""
    i = bisect.bisect_left(sizes, num_reqs)
    return sizes[i] if i < len(sizes) else None


def cudagraph_unsupported_reason(
    backends: Sequence[type[AttentionBackend]], device: torch.device
) -> str | None:
    """Why decode steps cannot run as CUDA graphs here (None: they can)."""
    from pagedcore.attention.backend import CudaGraphSupport

    return graph_support_reason(
        backends, device, CudaGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE,
        ">= UNIFORM_SINGLE_TOKEN_DECODE",
    )


def graph_support_reason(
    backends: Sequence[type[AttentionBackend]],
    device: torch.device | None,
    minimum: CudaGraphSupport,
    wanted: str,
) -> str | None:
    """Why steps cannot be captured when every backend must declare at least `minimum`
    (`wanted` says so in the message); None when they can. `device` None skips the device
    check (a test capturer)."""
    if device is not None and device.type != "cuda":
        return f"device is {device.type}, CUDA graphs need a CUDA device"
    weak = [
        f"{b.name} ({b.cudagraph_support.name})"
        for b in backends
        if b.cudagraph_support < minimum
    ]
    if weak:
        return (
            "backend(s) " + ", ".join(sorted(set(weak))) + " do not declare cudagraph_support "
            + wanted
        )
    return None


@attrs.frozen
class CapturedGraph:
    """A captured forward: `replay()` reruns it; `output` is its persistent result tensor;
    `release()` (when given) frees the graph before its owner goes (see
    `BucketedGraphs.release`)."""

    replay: Callable[[], None]
    output: torch.Tensor
    release: Callable[[], None] | None = None


class GraphCapturer(Protocol):
    """Turns a zero-argument forward into a `CapturedGraph`."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> CapturedGraph: ...


class CudaGraphCapturer:
    """Captures with `torch.cuda.CUDAGraph`; every graph shares one memory pool.

    Capture the largest bucket first: smaller graphs then reuse its pool memory.
    """

    def __init__(self, device: torch.device) -> None:
        import torch

        self.device = device
        self.pool: Any = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], torch.Tensor]) -> CapturedGraph:
        import torch

        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        # With tensor parallelism, NCCL's watchdog thread queries events while this thread
        # captures: "thread_local" keeps other threads' calls from invalidating the capture.
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        mode = "thread_local" if distributed else "global"
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode=mode):
            output = fn()
        torch.cuda.synchronize(self.device)
        return CapturedGraph(graph.replay, output, graph.reset)


class EagerCapturer:
    """Test stand-in for CUDA graphs: `replay()` calls the recorded forward again, eagerly,
    and copies its result into the persistent `output` tensor.

    Like a real graph, the replay sees only what was rewritten into the persistent buffers the
    forward closes over, so a step that forgets to update a buffer in place gives wrong
    output here too.
    """

    def __init__(self) -> None:
        self.num_captures = 0
        self.num_replays = 0

    def capture(self, fn: Callable[[], torch.Tensor]) -> CapturedGraph:
        output = fn().clone()
        self.num_captures += 1

        def replay() -> None:
            output.copy_(fn())
            self.num_replays += 1

        return CapturedGraph(replay, output)


class BucketedGraphs:
    """Captured forwards, one per bucket, over persistent buffers (the shared mechanics of
    `DecodeGraphs` and `pagedcore.engine.runner.mixed_graphs.MixedGraphs`).

    Parameters
    ----------
    sizes:
        Buckets (ascending, distinct, positive).
    capturer:
        How to capture (`CudaGraphCapturer` on a GPU).
    make_forward:
        ``make_forward(bucket)`` returns the forward to capture for `bucket`: a zero-argument
        callable that runs the base model over the buffers and returns ``[bucket, hidden]``
        hidden states. Subclasses fill the buffers with padding first (`_before_capture`).
    """

    #: What a bucket counts, for error messages.
    bucket_unit = "bucket"

    def __init__(
        self,
        *,
        sizes: Sequence[int],
        capturer: GraphCapturer,
        make_forward: Callable[[int], Callable[[], torch.Tensor]],
    ) -> None:
        sizes = sorted(set(sizes))
        if not sizes or sizes[0] < 1:
            raise ValueError(
                f"{self.bucket_unit} sizes must be positive integers, got {list(sizes)}"
            )
        self.sizes = sizes
        self.capturer = capturer
        self.make_forward = make_forward
        self.graphs: dict[int, CapturedGraph] = {}
        # Each bucket's forward, kept for the graph's lifetime: a graph does not own the
        # tensors its kernels touch, and the forward's closure holds the step context and
        # metadata, including scratch a backend allocated (outside the graph's pool) in the
        # warm-up run. Freed, that memory would be handed to other tensors and every replay
        # would overwrite them.
        self.forwards: dict[int, Callable[[], torch.Tensor]] = {}
        #: Seconds spent capturing (warm-up runs included).
        self.capture_seconds = 0.0

    def _before_capture(self) -> None:
        """Hook: prepare the persistent buffers before a bucket's forward is made."""

    def capture(self, bucket: int) -> CapturedGraph:
        """Warm up and capture `bucket`'s forward (once; later calls return the graph)."""
        graph = self.graphs.get(bucket)
        if graph is not None:
            return graph
        if bucket not in self.sizes:
            raise ValueError(f"{bucket} is not a {self.bucket_unit} size (sizes: {self.sizes})")
        t0 = time.perf_counter()
        self._before_capture()
        forward = self.make_forward(bucket)
        forward()  # warm-up: JIT compiles, autotunes and allocates outside the capture
        graph = self.capturer.capture(forward)
        self.forwards[bucket] = forward
        self.graphs[bucket] = graph
        self.capture_seconds += time.perf_counter() - t0
        return graph

    def capture_all(self) -> None:
        """Capture every bucket, largest first (smaller graphs reuse its pool memory)."""
        for bucket in reversed(self.sizes):
            self.capture(bucket)

    def release(self) -> None:
        """Free every captured graph now, not when the last reference goes. A graph that
        captured NCCL collectives holds the communicator: destroying or aborting it while
        the graph lives hangs (pytorch/pytorch#115388), so tensor parallelism releases the
        graphs first."""
        for graph in self.graphs.values():
            if graph.release is not None:
                graph.release()
        self.graphs.clear()
        self.forwards.clear()


class DecodeGraphs(BucketedGraphs):
    """One captured decode forward per batch-size bucket (parameters as `BucketedGraphs`;
    ``make_forward(bucket)`` fills the persistent buffers with a padding-only batch of
    `bucket` requests)."""

    bucket_unit = "capture"

    def bucket_for(self, num_reqs: int) -> int | None:
        """The bucket a decode batch of `num_reqs` requests is padded to (None: too big)."""
        return pick_bucket(num_reqs, self.sizes)

    def replay(self, bucket: int) -> torch.Tensor:
        """Replay `bucket`'s graph (capturing it first if needed); ``[bucket, hidden]``.

        The returned tensor is the graph's persistent output: read it before the next replay.
        """
        graph = self.capture(bucket)
        graph.replay()
        return graph.output
