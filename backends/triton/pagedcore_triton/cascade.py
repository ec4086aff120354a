"""Cascade attention in the Triton backend: plan (in the builder) and run (in the impl).

A cascade step is three launches per layer: the shared prefix for all queries at once
(`cascade_prefix_kernel`), the per-request suffixes (`paged_attention_kernel` over the block
table and ``seq_lens`` shifted past the prefix, forced to split so that it leaves partials),
and `cascade_merge_kernel`. Shifting keeps the causal mask right (it is aligned to each
sequence's end) and ALiBi would be too (relative positions), but layers with ALiBi or a
sliding window run the plain plan instead: the prefix kernel has neither (declared in the
plugin guide). Soft-cap is applied in both parts.

Cascade steps are planned from this step's lengths, so they run eagerly, never under a CUDA
graph: the engine plans a captured step with ``common_prefix_len=0`` (``docs/engine.md``).
"""

from __future__ import annotations

import attrs
import torch
import triton

from pagedcore.attention import CommonAttentionMetadata
from pagedcore_triton._env import interpreting
from pagedcore_triton.launch import PreparedLaunch
from pagedcore_triton.plan import LaunchPart

__all__ = ["CascadePlan", "plan_cascade", "run_cascade"]

#: Prefix programs the planner aims at (about two waves of an H200's 132 SMs).
TARGET_PREFIX_PROGRAMS = 512
#: Fewest prefix tiles a split-KV segment of the prefix holds.
MIN_PREFIX_TILES_PER_SEGMENT = 4
#: Largest prefix partials (bytes) a step may hold before the prefix stops splitting.
MAX_PREFIX_PARTIAL_BYTES = 64 << 20


@attrs.frozen(kw_only=True, eq=False)
class CascadePlan:
    """One cascade step.

    Attributes
    ----------
    prefix_len:
        Shared tokens ``P`` (a multiple of the block size).
    prefix_blocks:
        ``[P // block_size]`` int32 view of the first block-table row.
    suffix_seq_lens:
        ``[B]`` int32: ``seq_lens - P``.
    suffix_table:
        ``[B, max_blocks - P // block_size]`` int32 view of the block table past the prefix.
    suffix_part:
        The suffix launch over all requests and tokens (at least two segments: partials).
    num_tokens:
        Real query tokens ``T``.
    """

    prefix_len: int
    prefix_blocks: torch.Tensor
    suffix_seq_lens: torch.Tensor
    suffix_table: torch.Tensor
    suffix_part: LaunchPart
    num_tokens: int


def plan_cascade(
    common: CommonAttentionMetadata, prefix_len: int, block_size: int, part: LaunchPart
) -> CascadePlan:
    """The cascade plan of a step whose requests share `prefix_len` tokens; `part` is the
    builder's one-launch part over the whole step (its segment count is kept, at least 2)."""
    num_reqs = common.num_reqs
    n_blocks = prefix_len // block_size
    suffix_part = attrs.evolve(
        part,
        num_segments=max(2, part.num_segments),
        flat_programs=None,
        balanced_programs=None,
        min_segment_tokens=0,
    )
    return CascadePlan(
        prefix_len=prefix_len,
        prefix_blocks=common.block_table[0, :n_blocks],
        suffix_seq_lens=common.seq_lens[:num_reqs] - prefix_len,
        suffix_table=common.block_table[:num_reqs, n_blocks:],
        suffix_part=suffix_part,
        num_tokens=common.num_actual_tokens,
    )


def _prefix_grid(
    plan: CascadePlan, *, num_heads: int, num_kv_heads: int, head_pad: int, tile_n: int
) -> tuple[int, int, int, int]:
    """``(BLOCK_M, m_tiles, segments)`` and the tile count of the prefix launch."""
    rows = plan.num_tokens * (num_heads // num_kv_heads)
    block_m = min(16 if interpreting() else 128, max(16, triton.next_power_of_2(rows)))
    m_tiles = -(-rows // block_m)
    tiles = -(-plan.prefix_len // tile_n)
    segments = 2  # at least 2: the merge reduces over a segment axis (an empty one weighs 0)
    while (
        m_tiles * num_kv_heads * segments * 2 <= TARGET_PREFIX_PROGRAMS
        and tiles // (segments * 2) >= MIN_PREFIX_TILES_PER_SEGMENT
        and plan.num_tokens * num_heads * segments * 2 * head_pad * 4 <= MAX_PREFIX_PARTIAL_BYTES
    ):
        segments *= 2
    return block_m, m_tiles, segments, tiles


def run_cascade(
    plan: CascadePlan,
    suffix: PreparedLaunch,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    output: torch.Tensor,
    *,
    scale: float,
    logits_soft_cap: float | None,
) -> None:
    """Attention of a cascade step for one layer, written into `output` ``[T, Hq, D]``.

    `suffix` is `plan.suffix_part` prepared by `pagedcore_triton.ops.prepare_launch` over
    `plan.suffix_seq_lens` / `plan.suffix_table` (so it holds the suffix partials).
    """
    from pagedcore_triton.kernels.cascade import cascade_merge_kernel, cascade_prefix_kernel
    from pagedcore_triton.ops import run_launch

    _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
    num_tokens, num_heads = plan.num_tokens, query.shape[1]
    if num_tokens == 0:
        return
    run_launch(suffix, query, kv_cache, output, scale=scale, alibi_slopes=None,
               sliding_window=None, logits_soft_cap=logits_soft_cap, merge=False)
    assert suffix.part_acc is not None and suffix.part_ml is not None
    head_pad = triton.next_power_of_2(head_size)
    tile_n = max(block_size, 16 if interpreting() else 64)
    block_m, m_tiles, segments, _ = _prefix_grid(
        plan, num_heads=num_heads, num_kv_heads=num_kv_heads, head_pad=head_pad, tile_n=tile_n
    )
    device = query.device
    pfx_acc = torch.empty((num_tokens, num_heads, segments, head_pad), dtype=torch.float32,
                          device=device)
    pfx_ml = torch.empty((num_tokens, num_heads, segments, 2), dtype=torch.float32,
                         device=device)
    stride_cs = num_kv_heads * head_size
    cascade_prefix_kernel[(m_tiles, num_kv_heads, segments)](
        query, kv_cache, num_blocks * block_size * stride_cs, plan.prefix_blocks, pfx_acc,
        pfx_ml, num_tokens, plan.prefix_len, scale,
        1.0 if logits_soft_cap is None else logits_soft_cap,
        query.stride(0), query.stride(1), block_size * stride_cs, stride_cs, head_size,
        HEAD_SIZE=head_size, HEAD_PAD=head_pad, BLOCK_SIZE=block_size,
        QPK=num_heads // num_kv_heads, BLOCK_M=block_m, TILE_N=tile_n, NUM_SEGMENTS=segments,
        USE_SOFTCAP=logits_soft_cap is not None,
        DOT_FP32=interpreting() or query.dtype == torch.float32,
        num_warps=8 if block_m >= 128 else 4, num_stages=2,
    )
    cascade_merge_kernel[(num_tokens, num_heads)](
        output, suffix.part_acc, suffix.part_ml, pfx_acc, pfx_ml,
        output.stride(0), output.stride(1),
        HEAD_SIZE=head_size, HEAD_PAD=head_pad,
        SUFFIX_SEGMENTS=suffix.constexprs["NUM_SEGMENTS"], PREFIX_SEGMENTS=segments,
        num_warps=4,
    )
