"""CUDA graphs for mixed and prefill steps (any mix of decodes and prefill chunks).

An eager step of a small model costs far more host time (Python and ~750 kernel launches)
than GPU time, so prefill chunks and mixed steps gain from graphs as much as decodes do.
`MixedGraphs` captures the base model's forward once per *token* bucket ``T`` (16, ..., 256,
384, ..., 1024, 1280, ..., 2048, 3072, 4096, 6144, 8192, capped at ``max_num_batched_tokens``;
see `token_buckets`) over persistent
buffers of ``max_num_seqs`` request slots and ``T`` token slots. A step is prepared eagerly
as usual, then copied *on the device* into those buffers, padded as
`MetadataBuilder.build_for_cudagraph_capture` describes for mixed steps:

- padding requests (after the real ones): query length 0, ``seq_lens`` 0, a block-table row
  of zeros (the null block), so ``query_start_loc`` stays at the real token count;
- padding tokens (after the last real token): input id 0, position 0, ``slot_mapping`` -1,
  no request; their hidden states are discarded (logits are computed after the replay for
  the sampled rows only).

Used only when every KV-cache group's backend declares ``CudaGraphSupport.ALWAYS`` (and, for
real graphs, the device is CUDA); all-decode steps keep using `DecodeGraphs`, and a step with
more tokens than the largest bucket runs eagerly.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from pagedcore.attention.metadata import CommonAttentionMetadata
from pagedcore.engine.runner.cuda_graph import (
    BucketedGraphs,
    GraphCapturer,
    graph_support_reason,
    pick_bucket,
)

if TYPE_CHECKING:
    import torch

    from pagedcore.attention.backend import AttentionBackend, MetadataBuilder
    from pagedcore.engine.models.attention_hook import LayerBinding, StepContext
    from pagedcore.engine.runner.input_batch import InputBatch, StepInputs

__all__ = [
    "MixedBuffers",
    "MixedGraphs",
    "enable_mixed_graphs",
    "mixed_forward_over",
    "mixed_unsupported_reason",
    "token_buckets",
]


class GraphedRunner(Protocol):
    """What mixed-step graphs need of the model runner (`ModelRunner` is one)."""

    backends: list[type[AttentionBackend]]
    builders: list[MetadataBuilder[Any]]
    layers: dict[int, LayerBinding]
    input_batch: InputBatch
    device: torch.device
    max_num_seqs: int
    max_num_batched_tokens: int

    def _hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext
    ) -> torch.Tensor: ...


#: The largest default token bucket.
MAX_TOKEN_BUCKET = 8192


def token_buckets(max_num_batched_tokens: int) -> list[int]:
    """Token buckets: powers of two from 16 to 256, then steps of 128 up to 1024 and of 256
    up to 2048 (where chunked-prefill steps land: a chunk plus a few decodes pads by at most
    127 or 255 tokens, and the scheduler's bucket alignment has a bucket just below), then
    1.5x steps (3072, 4096, 6144, 8192: a padded prefill wastes at most a third of its GEMM
    work there), up to ``min(max_num_batched_tokens, 8192)``, plus that cap itself when it
    is not one.

    Examples
    --------
    >>> token_buckets(2048)  # doctest: +NORMALIZE_WHITESPACE
    [16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048]
    >>> token_buckets(100)
    [16, 32, 64, 100]
    """
    if max_num_batched_tokens < 1:
        raise ValueError(
            f"max_num_batched_tokens must be a positive integer, got {max_num_batched_tokens}"
        )
    cap = min(max_num_batched_tokens, MAX_TOKEN_BUCKET)
    sizes = []
    size = 16
    while size < cap:
        sizes.append(size)
        if size < 256:
            size *= 2
        elif size < 1024:
            size += 128
        elif size < 2048:
            size += 256
        else:
            size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    sizes.append(cap)
    return sizes


def mixed_unsupported_reason(
    backends: Sequence[type[AttentionBackend]], device: torch.device | None
) -> str | None:
    """Why mixed steps cannot run as CUDA graphs (None: they can); `device` None skips the
    device check (a test capturer)."""
    from pagedcore.attention.backend import CudaGraphSupport

    return graph_support_reason(backends, device, CudaGraphSupport.ALWAYS, "ALWAYS (mixed steps)")


class MixedBuffers:
    """Persistent device inputs of captured mixed steps, sized for the largest bucket.

    Parameters
    ----------
    max_num_seqs:
        Request slots ``R`` (every mixed graph covers all of them).
    max_num_tokens:
        The largest token bucket.
    max_blocks:
        Block-table width of each KV-cache group.
    max_model_len:
        The longest sequence a replay may hold.
    device:
        Where the model runs.
    """

    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_num_tokens: int,
        max_blocks: Sequence[int],
        max_model_len: int,
        device: torch.device,
    ) -> None:
        import torch

        self.num_reqs = max_num_seqs
        self.max_model_len = max_model_len
        i64, i32 = torch.int64, torch.int32
        self.input_ids = torch.zeros(max_num_tokens, dtype=i64, device=device)
        self.positions = torch.zeros(max_num_tokens, dtype=i64, device=device)
        self.query_start_loc = torch.zeros(max_num_seqs + 1, dtype=i32, device=device)
        self.seq_lens = torch.zeros(max_num_seqs, dtype=i32, device=device)
        self.slot_mappings = [
            torch.full((max_num_tokens,), -1, dtype=i64, device=device) for _ in max_blocks
        ]
        self.block_tables = [
            torch.zeros((max_num_seqs, m), dtype=i32, device=device) for m in max_blocks
        ]

    def write_padding(self) -> None:
        """Fill every slot with padding (the batch graphs are captured on)."""
        for t in (self.input_ids, self.positions, self.query_start_loc, self.seq_lens,
                  *self.block_tables):
            t.zero_()
        for s in self.slot_mappings:
            s.fill_(-1)

    def common(self, bucket: int) -> tuple[CommonAttentionMetadata, ...]:
        """Per group, the metadata of the `bucket`-token capture (what
        `MetadataBuilder.build_for_cudagraph_capture` receives): ``num_reqs`` = request
        slots, ``num_actual_tokens`` = ``max_query_len`` = `bucket`, ``max_seq_len`` =
        ``max_model_len``. The CPU copies hold the padding batch (nothing may read them)."""
        import torch

        qsl_cpu = torch.zeros(self.num_reqs + 1, dtype=torch.int32)
        seq_cpu = torch.zeros(self.num_reqs, dtype=torch.int32)
        return tuple(
            CommonAttentionMetadata(
                query_start_loc=self.query_start_loc,
                query_start_loc_cpu=qsl_cpu,
                seq_lens=self.seq_lens,
                seq_lens_cpu=seq_cpu,
                num_reqs=self.num_reqs,
                num_actual_tokens=bucket,
                max_query_len=bucket,
                max_seq_len=self.max_model_len,
                block_table=table,
                slot_mapping=slots[:bucket],
                positions=self.positions[:bucket],
                causal=True,
            )
            for table, slots in zip(self.block_tables, self.slot_mappings, strict=True)
        )

    def load(self, inputs: StepInputs, bucket: int) -> None:
        """Copy an eagerly prepared step into the buffers, in place and on the device, and
        pad it to `bucket` tokens and all request slots."""
        t = inputs.num_tokens
        first = inputs.common[0]
        n = first.num_reqs
        if t > bucket or n > self.num_reqs:
            raise ValueError(
                f"a step of {t} tokens / {n} requests does not fit the mixed bucket of "
                f"{bucket} tokens / {self.num_reqs} requests"
            )
        self.input_ids[:t].copy_(inputs.input_ids)
        self.input_ids[t:bucket].zero_()
        self.positions[:t].copy_(inputs.positions)
        self.positions[t:bucket].zero_()
        self.query_start_loc[: n + 1].copy_(first.query_start_loc)
        self.query_start_loc[n + 1 :].fill_(t)
        self.seq_lens[:n].copy_(first.seq_lens)
        self.seq_lens[n:].zero_()
        for common, table, slots in zip(
            inputs.common, self.block_tables, self.slot_mappings, strict=True
        ):
            slots[:t].copy_(common.slot_mapping)
            slots[t:bucket].fill_(-1)
            width = common.block_table.shape[1]
            table[:n, :width].copy_(common.block_table)
            table[:n, width:].zero_()
            table[n:].zero_()


class MixedGraphs(BucketedGraphs):
    """One captured mixed-step forward per token bucket.

    Parameters
    ----------
    sizes:
        Token buckets (ascending, distinct, positive).
    buffers:
        The persistent inputs every graph reads.
    capturer:
        How to capture (`CudaGraphCapturer` on a GPU; shared with `DecodeGraphs`, so the
        graphs share one memory pool).
    make_forward:
        ``make_forward(bucket)`` plans the `bucket`-token capture over `buffers` (already
        filled with padding) and returns a zero-argument forward returning ``[bucket,
        hidden]`` hidden states.
    """

    bucket_unit = "token bucket"

    def __init__(
        self,
        *,
        sizes: Sequence[int],
        buffers: MixedBuffers,
        capturer: GraphCapturer,
        make_forward: Callable[[int], Callable[[], torch.Tensor]],
    ) -> None:
        super().__init__(sizes=sizes, capturer=capturer, make_forward=make_forward)
        self.buffers = buffers
        #: Mixed steps served by a replay.
        self.num_replays = 0

    def _before_capture(self) -> None:
        self.buffers.write_padding()

    def bucket_for(self, inputs: StepInputs) -> int | None:
        """The token bucket of an eagerly prepared step (None: run it eagerly: a padded
        decode step, an empty one, or one larger than every bucket)."""
        if inputs.cudagraph_bucket is not None or inputs.num_tokens == 0:
            return None
        if inputs.common[0].num_reqs > self.buffers.num_reqs:
            return None
        return pick_bucket(inputs.num_tokens, self.sizes)

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Serve a step by a replay: ``[bucket, hidden]`` hidden states, the step's rows
        first (the graph's persistent output: read it before the next replay)."""
        bucket = self.bucket_for(inputs)
        if bucket is None:
            raise ValueError(
                f"no token bucket serves this step ({inputs.num_tokens} tokens; buckets "
                f"{self.sizes}); run it eagerly"
            )
        graph = self.capture(bucket)
        self.buffers.load(inputs, bucket)
        graph.replay()
        self.num_replays += 1
        return graph.output


def mixed_forward_over(
    runner: GraphedRunner, buffers: MixedBuffers, bucket: int, metadata: tuple[Any, ...]
) -> Callable[[], torch.Tensor]:
    """The zero-argument forward of `runner`'s base model over the first `bucket` token
    slots of `buffers` with these per-group plans, returning ``[bucket, hidden]`` (what a
    plain or cascade mixed-step graph records)."""
    import torch

    from pagedcore.engine.models import attention_hook

    ctx = attention_hook.StepContext(
        layers=runner.layers,
        metadata=metadata,
        slot_mappings=tuple(slots[:bucket] for slots in buffers.slot_mappings),
    )
    input_ids = buffers.input_ids[:bucket]
    positions = buffers.positions[:bucket]

    def forward() -> torch.Tensor:
        with torch.inference_mode():
            hidden: torch.Tensor = runner._hidden(input_ids, positions, ctx)
        return hidden

    return forward


def _make_forward(
    runner: GraphedRunner, buffers: MixedBuffers
) -> Callable[[int], Callable[[], torch.Tensor]]:
    """``bucket -> forward`` over `buffers` with the runner's builders, layers and model."""

    def make(bucket: int) -> Callable[[], torch.Tensor]:
        metadata = tuple(
            b.build_for_cudagraph_capture(c)
            for b, c in zip(runner.builders, buffers.common(bucket), strict=True)
        )
        return mixed_forward_over(runner, buffers, bucket, metadata)

    return make


def enable_mixed_graphs(
    runner: GraphedRunner,
    *,
    capturer: GraphCapturer,
    sizes: Sequence[int] | None = None,
    capture_now: bool = True,
    check_device: bool = True,
    strict: bool = False,
) -> tuple[MixedGraphs | None, str | None]:
    """Set up (and by default capture) mixed-step graphs for `runner`.

    Parameters
    ----------
    runner:
        The model runner whose decode graphs use `capturer`.
    capturer:
        The decode graphs' capturer (sharing its memory pool), or `EagerCapturer` in tests.
    sizes:
        Token buckets (None: `token_buckets` of ``max_num_batched_tokens``); buckets above
        ``max_num_batched_tokens`` are dropped.
    capture_now:
        Capture every bucket now (largest first) instead of on first use.
    check_device:
        Require a CUDA device (False with a test capturer).
    strict:
        Raise when capture fails instead of warning and serving mixed steps eagerly.

    Returns
    -------
    tuple
        ``(graphs, None)`` when enabled, else ``(None, why)``.
    """
    reason = mixed_unsupported_reason(runner.backends, runner.device if check_device else None)
    if reason is not None:
        return None, reason
    limit = runner.max_num_batched_tokens
    chosen = [s for s in (token_buckets(limit) if sizes is None else sizes) if s <= limit]
    if not chosen:
        raise ValueError(f"no token bucket in {sizes} is <= max_num_batched_tokens={limit}")
    buffers = MixedBuffers(
        max_num_seqs=runner.max_num_seqs,
        max_num_tokens=max(chosen),
        max_blocks=runner.input_batch.max_blocks,
        max_model_len=runner.input_batch.max_model_len,
        device=runner.device,
    )
    graphs = MixedGraphs(
        sizes=chosen, buffers=buffers, capturer=capturer,
        make_forward=_make_forward(runner, buffers),
    )
    if capture_now:
        try:
            graphs.capture_all()
        except Exception as exc:
            if strict:
                raise
            why = f"mixed-step capture failed: {type(exc).__name__}: {exc}"[:500]
            warnings.warn(f"{why}; mixed steps run eagerly", RuntimeWarning, stacklevel=2)
            return None, why
    return graphs, None
