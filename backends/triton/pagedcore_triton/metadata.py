"""The Triton backend's per-step metadata and its builder (the launch plan of a step)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from pagedcore.attention import (
    CommonAttentionMetadata,
    MetadataBuilder,
    split_decodes_and_prefills,
)
from pagedcore.attention.cascade import check_common_prefix_len
from pagedcore_triton._env import interpreting
from pagedcore_triton.plan import (
    DECODE_PLAN_ENV,
    LaunchPart,
    SplitRule,
    balanced_grid_size,
    balanced_pays,
    choose_num_segments,
    context_segments,
    decode_plan,
    tile_config,
)
from pagedcore_triton.plan_tma import tma_prefill_device, tma_prefill_spec

if TYPE_CHECKING:
    import torch

    from pagedcore.kv_cache.spec import AttentionSpec
    from pagedcore_triton.cascade import CascadePlan

__all__ = [
    "DECODE_PLAN_ENV",
    "MIXED_PLAN_ENV",
    "TritonAttentionMetadata",
    "TritonMetadataBuilder",
]

#: Bound on ``T * segments`` of a split mixed capture: its partials take ``T * Hq * segments
#: * (HEAD_PAD + 2)`` float32 per bucket (29 MB for 14 heads of 64 at 8192).
MIXED_SPLIT_TOKEN_SLOTS = 8192

#: Context tokens a flat mixed-capture segment holds at least (fewer tiles per program than
#: `SplitRule.min_tokens_per_segment` for decodes: a warm prefix hit's few q-blocks finish
#: sooner; the merge reads only the segments that saw keys).
MIXED_MIN_SEGMENT_TOKENS = 128

#: Fewest split-KV segments of a captured mixed cascade's suffix launch: split, its prefill
#: tiles leave partials for `cascade_merge_kernel` instead of folding the prefix's in.
MIXED_CASCADE_SEGMENTS = 2

#: ``classic`` plans captured mixed steps the way s3b1 measured (a grid over every request
#: slot and `TritonMetadataBuilder._mixed_segments` segments), for comparisons; unset or
#: ``flat`` uses the flat grid (`TritonMetadataBuilder._plan_mixed_capture`).
MIXED_PLAN_ENV = "PAGEDCORE_TRITON_MIXED_PLAN"


@attrs.frozen(kw_only=True)
class TritonAttentionMetadata:
    """The Triton backend's plan for one step.

    Attributes
    ----------
    query_start_loc:
        ``[B + 1]`` int32 on the device.
    seq_lens:
        ``[B]`` int32 on the device.
    block_table:
        ``[B, max_blocks]`` int32 on the device.
    num_actual_tokens:
        Real query tokens of the step.
    causal:
        Causal masking (decoder self-attention).
    parts:
        The kernel launches of the step, in order (a decode part first when the batch mixes
        decodes and prefills and `TritonMetadataBuilder.separate_decode_launch` is set).
    launches:
        Launches prepared by the first layer that ran this plan, reused by the others (keyed
        by part and layer shape; holds the split-KV scratch). Filled by the impl.
    cascade:
        The cascade plan when the step's requests share a prefix (`build`'s
        ``common_prefix_len``), else None. Layers that cannot cascade (ALiBi, a window) run
        `parts`.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    num_actual_tokens: int
    causal: bool
    parts: tuple[LaunchPart, ...]
    launches: dict[tuple[Any, ...], Any] = attrs.field(factory=dict, eq=False, repr=False)
    cascade: CascadePlan | None = None

    @classmethod
    def from_common(
        cls, common: CommonAttentionMetadata, parts: Sequence[LaunchPart]
    ) -> TritonAttentionMetadata:
        """The plan of `parts` over the step's shared metadata."""
        return cls(
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            block_table=common.block_table,
            num_actual_tokens=common.num_actual_tokens,
            causal=common.causal,
            parts=tuple(parts),
        )


class TritonMetadataBuilder(MetadataBuilder[TritonAttentionMetadata]):
    """Plans each step: launch parts (decode vs prefill tiles) and split-KV segments.

    Attributes
    ----------
    split_rule:
        When a decode launch splits its contexts (`SplitRule`); replace to tune. Its
        ``balanced`` field (or ``PAGEDCORE_TRITON_DECODE_PLAN=balanced``) selects the
        length-balanced decode plan (`balanced_decode`).
    separate_decode_launch:
        Serve the decodes of a mixed batch in their own launch with 16-row tiles instead of
        the prefill-sized tiles of one unified launch (measured faster on the H200; see
        ``docs/benchmarks/triton.md``).
    tma_prefill:
        Prefill-only launches go to the Hopper kernel (``kernels/prefill_tma.py``): set at
        construction from the device (compute capability 9.x, or
        ``PAGEDCORE_TRITON_PREFILL_KERNEL``) and the head size (`plan_tma`).
    """

    reorder_batch_threshold: ClassVar[int] = 1

    def __init__(
        self, kv_cache_spec: AttentionSpec, layer_names: Sequence[str], device: torch.device
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, device)
        self.split_rule = SplitRule()
        self.separate_decode_launch = True
        self.tma_prefill = tma_prefill_spec(kv_cache_spec.head_size) and tma_prefill_device(
            device, interpreting=interpreting()
        )

    def _part(
        self, common: CommonAttentionMetadata, begin: int, end: int, *, allow_split: bool,
        context_split: bool = False,
    ) -> LaunchPart:
        """The launch of requests ``[begin, end)``. `allow_split`: a decode part may split its
        contexts (`decode_segments`); `context_split`: a prefill part whose contexts
        dominate its queries may (`LaunchPart.context_segments`)."""
        qsl = common.query_start_loc_cpu
        q_lens = (qsl[begin + 1 : end + 1] - qsl[begin:end]).tolist()
        max_q = max(q_lens, default=0)
        seq_lens = common.seq_lens_cpu[begin:end].tolist()
        max_seq = max(seq_lens, default=0)
        segments = 1
        most = 1
        if context_split and max_q > 1:
            most = context_segments(
                self.split_rule, max_query_len=max_q, max_seq_len=max_seq,
                max_context_len=max(s - q for s, q in zip(seq_lens, q_lens, strict=True)),
            )
        if allow_split and max_q <= 1:
            segments = self.decode_segments(num_reqs=end - begin, max_seq_len=max_seq)
            if max_q <= 1 and end > begin and self.balanced_decode:
                lens = common.seq_lens_cpu[begin:end].tolist()
                if self._balanced_pays(lens, end - begin, segments):
                    return LaunchPart(
                        req_begin=begin, req_end=end, token_begin=int(qsl[begin]),
                        token_end=int(qsl[end]), max_query_len=max_q,
                        balanced_programs=self._balanced_programs(end - begin),
                        min_segment_tokens=self._decode_plan()[1],
                    )
        return LaunchPart(
            req_begin=begin,
            req_end=end,
            token_begin=int(qsl[begin]),
            token_end=int(qsl[end]),
            max_query_len=max_q,
            num_segments=segments,
            prefill_only=min(q_lens, default=0) > 1,
            tma_prefill=self.tma_prefill and min(q_lens, default=0) > 1 and segments == 1,
            has_context=any(s > q for s, q in zip(seq_lens, q_lens, strict=True)),
            context_segments=most,
            query_lens=tuple(q_lens) if most > 1 else (),
        )

    def decode_segments(self, *, num_reqs: int, max_seq_len: int) -> int:
        """Split-KV segments of a single-token decode launch of `num_reqs` requests whose
        longest context is `max_seq_len` (`choose_num_segments` by `split_rule`)."""
        return choose_num_segments(
            self.split_rule,
            num_reqs=num_reqs,
            num_kv_heads=self.kv_cache_spec.num_kv_heads,
            max_seq_len=max_seq_len,
            max_query_len=1,
        )

    @property
    def balanced_decode(self) -> bool:
        """Decode launches use the length-balanced plan: ``PAGEDCORE_TRITON_DECODE_PLAN``
        (``balanced`` / ``uniform``) when set, else ``split_rule.balanced``."""
        return self._decode_plan()[0]

    def _decode_plan(self) -> tuple[bool, int]:
        """``(balanced, min_tokens_per_segment)``: `decode_plan` of the rule and
        ``PAGEDCORE_TRITON_DECODE_PLAN``."""
        return decode_plan(self.split_rule, os.environ.get(DECODE_PLAN_ENV, ""))

    def _balanced_programs(self, num_reqs: int) -> int:
        return balanced_grid_size(
            self.split_rule, num_reqs=num_reqs, num_kv_heads=self.kv_cache_spec.num_kv_heads
        )

    def _balanced_pays(self, seq_lens: list[int], num_reqs: int, segments: int) -> bool:
        """`balanced_pays` for an eager decode step (the uniform plan: `segments` each)."""
        tile_n = tile_config(1, 1, self.kv_cache_spec.head_size, interpreting=interpreting(),
                             kv_itemsize=self.kv_cache_spec.element_size).tile_n
        return balanced_pays(
            seq_lens, budget=self._balanced_programs(num_reqs) - num_reqs, tile_n=tile_n,
            min_tiles=max(1, self._decode_plan()[1] // tile_n), uniform_segments=segments,
        )

    def build(
        self, common: CommonAttentionMetadata, *, common_prefix_len: int = 0
    ) -> TritonAttentionMetadata:
        """Plan one step.

        With ``common_prefix_len > 0`` (the engine's cascade request) the metadata also holds
        a `CascadePlan` (``pagedcore_triton.cascade``) over the shared prefix blocks.

        With the balanced decode plan (`balanced_decode`), a decode launch runs on the
        length-balanced grid when that shortens its longest program by more than
        `BALANCED_GAIN` (skewed lengths); otherwise the uniform plan's launch serves it.
        """
        num_reqs = common.num_reqs
        parts: list[LaunchPart] = []
        if num_reqs > 0:
            try:
                num_decodes, num_prefills, _, _ = split_decodes_and_prefills(
                    common, self.reorder_batch_threshold
                )
            except ValueError:  # not decode-first: one unified launch
                num_decodes, num_prefills = 0, num_reqs
            if self.separate_decode_launch and num_decodes and num_prefills:
                parts.append(self._part(common, 0, num_decodes, allow_split=True))
                parts.append(self._part(common, num_decodes, num_reqs, allow_split=False,
                                        context_split=True))
            else:
                parts.append(self._part(common, 0, num_reqs, allow_split=True,
                                        context_split=True))
        meta = TritonAttentionMetadata.from_common(common, parts)
        if common_prefix_len and num_reqs > 1:
            check_common_prefix_len(
                common_prefix_len,
                block_size=self.kv_cache_spec.block_size,
                context_lens=common.context_lens_cpu[:num_reqs].tolist(),
            )
            from pagedcore_triton.cascade import overlap_enabled, plan_cascade

            whole = self._part(common, 0, num_reqs, allow_split=False)
            overlap = overlap_enabled(self.device)
            if whole.max_query_len <= 1:  # decodes: split-KV by the suffix lengths
                longest = int(common.seq_lens_cpu[:num_reqs].max()) - common_prefix_len
                whole = attrs.evolve(whole, num_segments=_suffix_segments(
                    self.decode_segments(num_reqs=num_reqs, max_seq_len=longest), overlap))
            plan = plan_cascade(common, common_prefix_len, self.kv_cache_spec.block_size, whole,
                                overlap=overlap)
            meta = attrs.evolve(meta, cascade=plan)
        return meta

    def build_for_cudagraph_capture(
        self, common: CommonAttentionMetadata
    ) -> TritonAttentionMetadata:
        """Plan a uniform single-token decode batch once, valid for every replay.

        One launch over all ``num_reqs`` requests; its split-KV segments come from
        ``common.max_seq_len`` (the longest sequence a replay may hold), never from this
        step's lengths. Segments that a shorter sequence leaves empty contribute nothing to
        the merge, so the plan is exact for every ``seq_lens`` in ``[1, max_seq_len]``. With
        the balanced decode plan (`balanced_decode`) the launch is the length-balanced grid
        of `balanced_grid_size` programs per KV head instead, which sizes each request's
        segments from ``seq_lens`` at run time (``kernels/balanced.py``).

        A mixed token bucket (``max_query_len == num_actual_tokens == T > 1``) gets one
        launch over all ``num_reqs`` requests and ``T`` tokens with prefill tiles on a flat
        grid whose split-KV adapts to the step at run time (`_plan_mixed_capture`).
        """
        mixed = 1 < common.max_query_len == common.num_actual_tokens
        if not mixed and (
            common.max_query_len > 1 or common.num_actual_tokens != common.num_reqs
        ):
            raise ValueError(
                "build_for_cudagraph_capture serves uniform single-token decode batches or "
                "mixed token buckets (max_query_len == num_actual_tokens) only "
                f"(got max_query_len={common.max_query_len}, "
                f"num_actual_tokens={common.num_actual_tokens}, num_reqs={common.num_reqs}); "
                "plan other steps with build()"
            )
        if common.block_table.stride(-1) != 1:
            raise ValueError(
                "build_for_cudagraph_capture needs a block table with a contiguous last "
                "dimension: the plan keeps a view of the buffer the engine rewrites in place"
            )
        if mixed:
            return self._plan_mixed_capture(common)
        num_reqs = common.num_reqs
        if self.balanced_decode and num_reqs > 0:
            return _one_launch(
                common, token_end=num_reqs, max_query_len=1, num_segments=1,
                balanced_programs=self._balanced_programs(num_reqs),
                min_segment_tokens=self._decode_plan()[1],
            )
        segments = self.decode_segments(num_reqs=num_reqs, max_seq_len=common.max_seq_len)
        return _one_launch(common, token_end=num_reqs, max_query_len=1, num_segments=segments)

    def build_cascade_for_cudagraph_capture(
        self,
        common: CommonAttentionMetadata,
        prefix_len: torch.Tensor,
        capacity: int,
        *,
        suffix_seq_lens: torch.Tensor | None = None,
        suffix_table: torch.Tensor | None = None,
    ) -> TritonAttentionMetadata:
        """`build_for_cudagraph_capture`'s decode plan with a graph cascade plan
        (`pagedcore_triton.cascade.plan_graph_cascade`): the shared prefix length is the
        ``[1]`` int32 device scalar `prefix_len` (up to `capacity` tokens), the suffix
        buffers are static (allocated here unless given), so the captured launches serve
        every replay of the bucket. The suffix launch splits for ``common.max_seq_len`` like
        the plain capture plan; `prepare_replay` refills the suffix buffers from the replay's
        lengths and block table (`pagedcore_triton.cascade.fill_graph_cascade`). Layers
        with ALiBi, a window, sinks or an fp8 cache run the plain capture plan.

        A mixed token bucket (``max_query_len == num_actual_tokens == T > 1``) gets the
        mixed capture plan (for the layers that run plain) and a suffix launch on the classic
        grid of `_plan_mixed_capture_classic`, split in at least `MIXED_CASCADE_SEGMENTS`:
        its prefill tiles then leave partials for `cascade_merge_kernel` instead of folding
        the prefix's in themselves (the fused form crashed ptxas for long chunks, see
        `pagedcore_triton.cascade.MAX_SUFFIX_ROWS`)."""
        import torch

        from pagedcore_triton.cascade import overlap_enabled, plan_graph_cascade

        meta = self.build_for_cudagraph_capture(common)  # also checks the bucket's shape
        mixed = common.max_query_len > 1
        n, width = common.num_reqs, common.block_table.shape[1]
        if suffix_seq_lens is None:
            suffix_seq_lens = torch.zeros(n, dtype=torch.int32, device=common.seq_lens.device)
        if suffix_table is None:
            suffix_table = torch.zeros((n, width), dtype=torch.int32,
                                       device=common.block_table.device)
        overlap = overlap_enabled(self.device)
        if mixed:
            classic = self._plan_mixed_capture_classic(common).parts[0]
            whole = attrs.evolve(classic, num_segments=max(
                MIXED_CASCADE_SEGMENTS, classic.num_segments))
        else:
            segments = _suffix_segments(self.decode_segments(
                num_reqs=common.num_reqs, max_seq_len=common.max_seq_len), overlap)
            whole = attrs.evolve(meta.parts[0], num_segments=segments, balanced_programs=None)
        plan = plan_graph_cascade(common, prefix_len, capacity,
                                  self.kv_cache_spec.block_size, whole,
                                  suffix_seq_lens=suffix_seq_lens, suffix_table=suffix_table,
                                  overlap=overlap)
        return attrs.evolve(meta, cascade=plan)

    def prepare_replay(self, metadata: TritonAttentionMetadata,
                       common: CommonAttentionMetadata) -> None:
        """A graph cascade plan's suffix buffers, refilled for this replay (device ops only:
        ``seq_lens - P`` and the block table shifted past the prefix); other plans read the
        engine's buffers at run time and need nothing."""
        plan = metadata.cascade
        if plan is None or plan.prefix_len_dev is None:
            return
        from pagedcore_triton.cascade import fill_graph_cascade

        fill_graph_cascade(common, plan.prefix_len_dev, self.kv_cache_spec.block_size,
                           plan.suffix_seq_lens, plan.suffix_table)

    def _plan_mixed_capture(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        """One unified launch on a flat grid for a captured mixed step of ``T`` token slots.

        A captured step's cost must follow its work, not the worst case: the classic grid
        (one q-block range per request slot times segments sized for ``max_model_len``)
        launched 8192 mostly empty programs for a 16-token bucket with 64 request slots and
        took ~45 us per layer on the H200 whatever the context. The flat grid has
        `flat_grid_size` programs per KV head: at most ``cdiv(T, BLOCK_Q) + min(R, T)``
        q-blocks (a ``T``-token step holds at most ``T`` non-empty requests), grown to the
        split budget ``split_rule.target_programs / Hkv``. At run time every program reads
        ``query_start_loc`` to find how many q-blocks the step uses, gives each of them as
        many segments (a power of two, at most `_max_mixed_segments`) as the grid holds, and
        exits at once when it gets none; a segment that a short context leaves empty exits
        before loading anything, and a step left unsplit writes its output directly (the
        merge then returns at once). Only shapes enter the plan, so it stays valid for any
        contents the contract allows. ``PAGEDCORE_TRITON_MIXED_PLAN=classic`` restores the
        previous plan.
        """
        if os.environ.get(MIXED_PLAN_ENV, "flat") == "classic":
            return self._plan_mixed_capture_classic(common)
        rule = self.split_rule
        return _one_launch(
            common,
            token_end=common.num_actual_tokens,
            max_query_len=common.max_query_len,
            num_segments=self._max_mixed_segments(common.num_actual_tokens, common.max_seq_len),
            flat_programs=max(1, rule.target_programs // self.kv_cache_spec.num_kv_heads),
            min_segment_tokens=min(rule.min_tokens_per_segment, MIXED_MIN_SEGMENT_TOKENS),
        )

    def _max_mixed_segments(self, num_tokens: int, max_seq_len: int) -> int:
        """Most segments a flat mixed capture may give one q-block: a power of two at most
        ``split_rule.max_segments``, keeping ``split_rule.min_tokens_per_segment`` tokens of
        `max_seq_len` per segment and at most ``MIXED_SPLIT_TOKEN_SLOTS`` token-segments of
        partials."""
        rule = self.split_rule
        segments = 1
        while (
            segments * 2 <= rule.max_segments
            and max_seq_len // (segments * 2) >= rule.min_tokens_per_segment
            and num_tokens * segments * 2 <= MIXED_SPLIT_TOKEN_SLOTS
        ):
            segments *= 2
        return segments

    def _plan_mixed_capture_classic(
        self, common: CommonAttentionMetadata
    ) -> TritonAttentionMetadata:
        """The previous mixed plan (``PAGEDCORE_TRITON_MIXED_PLAN=classic``): one launch.

        The grid (``T // BLOCK_Q + num_reqs`` q-blocks) depends only on ``T`` and
        ``num_reqs``; the kernel finds each program's request from ``query_start_loc`` at
        run time, and a program whose request has fewer query tokens than its offset (every
        program of a padding request with query length 0 and ``seq_lens`` 0) returns before
        reading anything else. Padding tokens after the last real one belong to no program.
        Prefill tiles (from ``max_query_len = T``) and `_mixed_segments` split-KV segments,
        so nothing depends on the buffers' values.
        """
        return _one_launch(
            common,
            token_end=common.num_actual_tokens,
            max_query_len=common.max_query_len,
            num_segments=self._mixed_segments(common.num_actual_tokens, common.max_seq_len),
        )

    def _mixed_segments(self, num_tokens: int, max_seq_len: int) -> int:
        """Split-KV segments of a mixed capture of `num_tokens` token slots.

        A small bucket holds few q-blocks (a 64-token chunk of a GQA-7 model is 4 q-blocks
        per KV head), each walking its whole context alone: on the H200 a warm prefix hit of
        4K tokens then took ~5 ms of attention on 8 SMs. So, from the shapes only, split the
        context like a decode launch does (`split_rule`), estimating ``cdiv(T, 16) * Hkv``
        programs (16 query tokens per q-block, a bound for GQA groups up to 8), and keep the
        split partials at most ``MIXED_SPLIT_TOKEN_SLOTS`` token-segments. Segments that a
        shorter context leaves empty weigh nothing in the merge.
        """
        rule = self.split_rule
        programs = -(-num_tokens // 16) * self.kv_cache_spec.num_kv_heads
        segments = 1
        while (
            segments * 2 <= rule.max_segments
            and programs * segments * 2 <= rule.target_programs
            and max_seq_len // (segments * 2) >= rule.min_tokens_per_segment
            and num_tokens * segments * 2 <= MIXED_SPLIT_TOKEN_SLOTS
        ):
            segments *= 2
        return segments


def _one_launch(
    common: CommonAttentionMetadata,
    *,
    token_end: int,
    max_query_len: int,
    num_segments: int,
    flat_programs: int | None = None,
    min_segment_tokens: int = 0,
    balanced_programs: int | None = None,
) -> TritonAttentionMetadata:
    """Metadata of a captured step planned as one launch over all its request slots and its
    first `token_end` token slots (no launch without requests)."""
    part = LaunchPart(
        req_begin=0,
        req_end=common.num_reqs,
        token_begin=0,
        token_end=token_end,
        max_query_len=max_query_len,
        num_segments=num_segments,
        flat_programs=flat_programs,
        min_segment_tokens=min_segment_tokens,
        balanced_programs=balanced_programs,
    )
    return TritonAttentionMetadata.from_common(common, (part,) if common.num_reqs > 0 else ())


def _suffix_segments(segments: int, overlap: bool) -> int:
    """A decode cascade's suffix split: `segments`, at least 2 when the prefix launch runs
    beside the suffix launch (`overlap`, ``PAGEDCORE_TRITON_CASCADE_OVERLAP``: the suffix then
    leaves partials for the merge instead of folding in the prefix's)."""
    return max(segments, 2) if overlap else segments
