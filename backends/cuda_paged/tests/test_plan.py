"""Decode pass selection, partition arithmetic and prefill tiling (pure CPU arithmetic)."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pagedcore_cuda_paged.plan import (
    MMA_MAX_HEAD_SIZE,
    PREFILL_TILE_ROWS,
    DecodeKernel,
    DecodePass,
    DecodePolicy,
    PrefillKernel,
    decode_grouped_smem_bytes,
    decode_mma_smem_bytes,
    decode_plan,
    decode_smem_bytes,
    decode_span,
    num_partitions,
    prefill_kernel_code,
    prefill_tiles,
)

BIG_SMEM = 227 * 1024


def plan(seq_lens: list[int], *, mma: bool = False, **kw: object) -> object:
    """decode_plan with the CLASSIC kernel unless `mma` (these tests pin the kernel family)."""
    args: dict[str, object] = dict(num_heads=32, num_kv_heads=32, head_size=128,
                                   block_size=16,
                                   sliding_window=None, policy=DecodePolicy(),
                                   smem_limit=BIG_SMEM)
    args.update(kw)
    kernel = DecodeKernel.MMA if mma else DecodeKernel.CLASSIC
    args["policy"] = attrs.evolve(args["policy"], kernel=kernel)  # type: ignore[misc]
    return decode_plan(seq_lens, **args)  # type: ignore[arg-type]


def test_smem_formula_matches_csrc() -> None:
    # csrc/params.h: 4 * (head + partition + 4 * head + 32)
    assert decode_smem_bytes(128, 512) == 4 * (128 + 512 + 4 * 128 + 32)


@given(seq=st.integers(1, 100_000), part_blocks=st.integers(1, 64),
       block=st.sampled_from([8, 16, 32]), window=st.none() | st.integers(1, 5000))
def test_partitions_cover_exactly_the_visible_keys(seq: int, part_blocks: int, block: int,
                                                   window: int | None) -> None:
    part = part_blocks * 32
    begin, ctx_start = decode_span(seq, block_size=block, sliding_window=window)
    n = num_partitions(seq, partition_size=part, block_size=block, sliding_window=window)
    assert begin % block == 0 and begin <= ctx_start < begin + block
    # Visible keys are [ctx_start, seq): all inside the n partitions, none of them empty.
    assert begin + (n - 1) * part < seq <= begin + n * part
    assert ctx_start == (0 if window is None else max(0, seq - window))


def test_partition_examples() -> None:
    assert num_partitions(1, partition_size=512, block_size=16, sliding_window=None) == 1
    assert num_partitions(512, partition_size=512, block_size=16, sliding_window=None) == 1
    assert num_partitions(513, partition_size=512, block_size=16, sliding_window=None) == 2
    # Window 100 over 1000 tokens: keys 900..999, partitions start at block 896.
    assert decode_span(1000, block_size=16, sliding_window=100) == (896, 900)
    assert num_partitions(1000, partition_size=64, block_size=16, sliding_window=100) == 2


def test_one_pass_when_many_blocks_or_short() -> None:
    launch = plan([4096] * 256)  # 256 * 32 = 8192 thread blocks >= 8192
    assert launch.mode is DecodePass.ONE_PASS
    assert launch.partition_size == 4096 and launch.max_partitions == 1
    short = plan([1000])  # shorter than one 1024-token partition: nothing to split
    assert short.mode is DecodePass.ONE_PASS and short.partition_size == 1008
    assert plan([4096] * 128).mode is DecodePass.PARTITIONED  # 4096 blocks: partitions win


def test_partitioned_when_few_blocks_and_long() -> None:
    launch = plan([32768] * 8, policy=DecodePolicy(partition_size=512))
    assert launch.mode is DecodePass.PARTITIONED
    assert launch.partition_size == 512 and launch.max_partitions == 64


def test_partitioned_when_one_pass_does_not_fit_shared_memory() -> None:
    launch = plan([100_000] * 512)  # plenty of blocks, but 400 KB of scores
    assert launch.mode is DecodePass.PARTITIONED
    forced = plan([100_000], policy=DecodePolicy(force=DecodePass.ONE_PASS))
    assert forced.mode is DecodePass.PARTITIONED


def test_force_and_window_spans() -> None:
    forced = plan([4096] * 256, policy=DecodePolicy(force=DecodePass.PARTITIONED,
                                                   partition_size=1024))
    assert forced.mode is DecodePass.PARTITIONED and forced.max_partitions == 4
    # A window shortens the one pass's span to the window (+ block misalignment).
    windowed = plan([10_005], sliding_window=256)
    assert windowed.mode is DecodePass.ONE_PASS and windowed.partition_size == 272


def test_policy_validation() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        DecodePolicy(partition_size=48)
    with pytest.raises(ValueError, match="positive"):
        DecodePolicy(min_one_pass_blocks=0)
    with pytest.raises(ValueError, match="shared memory"):
        plan([100_000], policy=DecodePolicy(partition_size=65536), smem_limit=48 * 1024)


def test_prefill_tiles_cover_rows_of_multi_token_requests() -> None:
    tiles = prefill_tiles([1, 130, 0, 2, 64, 1])
    assert tiles == [(1, 0), (1, 64), (1, 128), (3, 0), (4, 0)]
    assert prefill_tiles([1, 130, 0, 2], 128) == [(1, 0), (1, 128), (3, 0)]
    assert PREFILL_TILE_ROWS == 64


def _head_major_block(bx: int, by: int, items: int, heads: int) -> tuple[int, int]:
    """(tile, query head) of thread block (bx, by) in the head-major prefill order: the
    formula of csrc/prefill_mma.cuh with HMAJOR (grid (items, heads), launched x fastest)."""
    linear = by * items + bx
    return items - 1 - linear // heads, linear % heads


@pytest.mark.parametrize(("items", "heads"), [(1, 1), (5, 32), (64, 28), (3, 7)])
def test_head_major_order_covers_every_tile_and_head_once(items: int, heads: int) -> None:
    launch = [_head_major_block(bx, by, items, heads)
              for by in range(heads) for bx in range(items)]  # hardware launch order
    assert sorted(launch) == [(t, h) for t in range(items) for h in range(heads)]
    # Heaviest (last-listed) tiles first, all heads of a tile in consecutive blocks.
    assert launch[:heads] == [(items - 1, h) for h in range(heads)]
    assert [t for t, _ in launch] == sorted((t for t, _ in launch), reverse=True)


def test_grouping_counts_kv_heads_and_sizes_shared_memory() -> None:
    # 256 decodes x 8 KV heads = 2048 grouped blocks: too few for the one pass at 4096 tokens.
    grouped = plan([4096] * 256, num_heads=32, num_kv_heads=8)
    assert grouped.grouped and grouped.mode is DecodePass.PARTITIONED
    assert grouped.partition_size == 1024 and grouped.max_partitions == 4
    per_head = plan([4096] * 256, num_heads=32, num_kv_heads=8,
                    policy=DecodePolicy(group_heads=False))
    assert not per_head.grouped and per_head.mode is DecodePass.ONE_PASS
    # MHA never groups; a group of 8 keeps 8 score rows, so long one passes stop fitting.
    assert not plan([100], num_heads=8, num_kv_heads=8).grouped
    assert decode_grouped_smem_bytes(128, 512, 4) == 4 * (4 * 128 + 4 * 512 + 4 * 8 * 128 + 8)
    forced = plan([8192], num_heads=32, num_kv_heads=4,
                  policy=DecodePolicy(force=DecodePass.ONE_PASS))
    assert forced.grouped and forced.mode is DecodePass.PARTITIONED  # 8 * 8192 * 4 B > 227 KB


def test_mma_one_pass_has_no_shared_memory_bound() -> None:
    # Scores live in registers: a 100k-token one pass fits where CLASSIC must partition.
    launch = plan([100_000] * 512, mma=True, num_kv_heads=8,
                  policy=DecodePolicy(min_one_pass_blocks=64))
    assert launch.kernel is DecodeKernel.MMA and launch.kernel_code == 1
    assert launch.mode is DecodePass.ONE_PASS and launch.grouped
    assert decode_mma_smem_bytes(128) == 4 * 4 * 16 * (128 + 2)  # csrc/params.h


def test_mma_block_count_is_per_kv_head_and_16_head_chunk() -> None:
    # 8 decodes x 8 KV heads = 64 blocks < min: partitioned; 16 decodes x 2 chunks x 2 = 64.
    pol = DecodePolicy(partition_size=512, min_one_pass_blocks=65)
    assert plan([4096] * 8, mma=True, num_kv_heads=8, policy=pol).mode is DecodePass.PARTITIONED
    pol = DecodePolicy(partition_size=512, min_one_pass_blocks=64)
    assert plan([4096] * 8, mma=True, num_kv_heads=8, policy=pol).mode is DecodePass.ONE_PASS
    wide = plan([4096] * 16, mma=True, num_heads=64, num_kv_heads=2, policy=pol)
    assert wide.mode is DecodePass.ONE_PASS  # 16 * 2 * ceil(32 / 16) = 64 blocks
    launch = plan([4096] * 8, mma=True, num_kv_heads=8,
                  policy=DecodePolicy(partition_size=512, force=DecodePass.PARTITIONED,
                                      unroll=2))
    assert launch.max_partitions == 8 and launch.unroll == 2


def test_mma_falls_back_to_classic_where_it_does_not_apply() -> None:
    fp32 = plan([100], mma=True, is_float32=True)
    assert fp32.kernel is DecodeKernel.CLASSIC and fp32.kernel_code == 0 and fp32.unroll == 1
    big = plan([100], mma=True, head_size=256, policy=DecodePolicy(unroll=2))
    assert big.kernel is DecodeKernel.CLASSIC and big.unroll == 1
    assert plan([100], mma=True, head_size=MMA_MAX_HEAD_SIZE).kernel is DecodeKernel.MMA
    assert prefill_kernel_code(PrefillKernel.MMA, head_size=128, is_float32=False) == (0, 64)
    assert prefill_kernel_code(PrefillKernel.MMA_128, head_size=80, is_float32=False) == (0, 128)
    assert prefill_kernel_code(PrefillKernel.MMA, head_size=256, is_float32=False) == (1, 64)
    assert prefill_kernel_code(PrefillKernel.MMA_128, head_size=64, is_float32=True) == (1, 64)
    assert prefill_kernel_code(PrefillKernel.WMMA, head_size=64, is_float32=False) == (1, 64)
    assert prefill_kernel_code(PrefillKernel.MMA_PIPE, head_size=64, is_float32=False) == (3, 64)
    code = prefill_kernel_code(PrefillKernel.MMA_128_PIPE, head_size=128, is_float32=False)
    assert code == (3, 128)
    assert prefill_kernel_code(PrefillKernel.MMA_128_PIPE, head_size=256,
                               is_float32=False) == (1, 64)
    code = prefill_kernel_code(PrefillKernel.WMMA_LANE_PER_KEY, head_size=64, is_float32=False)
    assert code == (2, 64)
    for kern, want in ((PrefillKernel.MMA_W8_PIPE, (4, 128)),
                       (PrefillKernel.MMA_128_K32_PIPE, (5, 128)),
                       (PrefillKernel.MMA_256_K32_PIPE, (6, 256)),
                       (PrefillKernel.MMA_128_K32_3STAGE, (7, 128)),
                       (PrefillKernel.MMA_W8_3STAGE, (8, 128)),
                       (PrefillKernel.MMA_128_K32_3STAGE_FAST, (9, 128)),
                       (PrefillKernel.MMA_128_FAST, (10, 128)),
                       (PrefillKernel.MMA_128_K32_3STAGE_FAST_HM, (11, 128)),
                       (PrefillKernel.MMA_64_K32_3STAGE_FAST_HM, (12, 64)),
                       (PrefillKernel.MMA_128_K32_4STAGE_FAST_HM, (13, 128)),
                       (PrefillKernel.MMA_128_FAST_HM, (14, 128)),
                       (PrefillKernel.MMA_128_FAST_WM, (15, 128)),
                       (PrefillKernel.MMA_128_FAST_HM_WM, (16, 128)),
                       (PrefillKernel.MMA_128_FAST_WM_1B, (17, 128)),
                       (PrefillKernel.MMA_128_FAST_WMP, (18, 128)),
                       (PrefillKernel.MMA_128_FAST_WMP_1B, (19, 128))):
        assert prefill_kernel_code(kern, head_size=112, is_float32=False) == want
        assert prefill_kernel_code(kern, head_size=128, is_float32=True) == (1, 64)
    with pytest.raises(ValueError, match="unroll"):
        DecodePolicy(unroll=4)
    assert plan([100], mma=True, policy=DecodePolicy(unroll=3)).unroll == 3


def test_mma_measured_defaults() -> None:
    # docs/benchmarks/cuda_paged.md: one pass from 512 blocks or up to 1024 tokens (unroll 2);
    # else the smallest of 512/1024/2048-token partitions keeping the grid <= 256 blocks.
    def mma_plan(batch: int, ctx: int) -> object:
        return plan([ctx] * batch, mma=True, num_kv_heads=8)

    for batch, ctx in [(64, 4096), (256, 1024), (1, 1024), (128, 16384)]:
        launch = mma_plan(batch, ctx)
        assert launch.mode is DecodePass.ONE_PASS and launch.unroll == 2, (batch, ctx)
    for batch, ctx, part in [(8, 32768, 2048), (1, 16384, 512), (4, 4096, 512),
                             (16, 4096, 2048), (1, 32768, 1024)]:
        launch = mma_plan(batch, ctx)
        assert launch.mode is DecodePass.PARTITIONED and launch.unroll == 1, (batch, ctx)
        assert launch.partition_size == part, (batch, ctx, launch.partition_size)
    classic = plan([32768] * 8)  # CLASSIC keeps its own measured 1024-token partitions
    assert classic.partition_size == 1024
