"""Launchers of the length-balanced decode (``kernels/balanced.py``; imports triton).

`prepare_balanced` and `run_balanced` are `pagedcore_triton.ops.prepare_launch` and
`run_launch` for a part with `LaunchPart.balanced_programs`.
"""

from __future__ import annotations

import math
import os

import torch
import triton

from pagedcore_triton._env import interpreting
from pagedcore_triton.kernels.balanced import balanced_decode_kernel, balanced_merge_kernel
from pagedcore_triton.launch import PreparedLaunch
from pagedcore_triton.plan import (
    BALANCED_ORDER_ENV,
    BALANCED_ORDERS,
    DEFAULT_BALANCED_ORDER,
    LaunchPart,
    TileConfig,
    kv_convert,
)

__all__ = ["prepare_balanced", "run_balanced"]


def prepare_balanced(
    part: LaunchPart,
    cfg: TileConfig,
    *,
    num_heads: int,
    head_pad: int,
    dtype: torch.dtype,
    kv_cache_shape: tuple[int, ...],
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    use_alibi: bool,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    kv_fp8: bool = False,
    use_sinks: bool = False,
) -> PreparedLaunch:
    """`prepare_launch` of a length-balanced decode part (``kernels/balanced.py``)."""
    assert part.balanced_programs is not None
    _, num_blocks, block_size, num_kv_heads, head_size = kv_cache_shape
    qpk = num_heads // num_kv_heads
    programs = part.balanced_programs
    if programs <= part.num_reqs:
        raise ValueError(
            f"a balanced decode grid needs more programs per KV head ({programs}) than "
            f"requests ({part.num_reqs}); use pagedcore_triton.plan.balanced_grid_size"
        )
    order = os.environ.get(BALANCED_ORDER_ENV, DEFAULT_BALANCED_ORDER)
    if order not in BALANCED_ORDERS:
        raise ValueError(
            f"{BALANCED_ORDER_ENV}={order!r}: expected one of {', '.join(BALANCED_ORDERS)}"
        )
    heads_first, round_robin = BALANCED_ORDERS[order]
    table = block_table[part.req_begin : part.req_end]
    if table.stride(-1) != 1:
        table = table.contiguous()
    device = query_start_loc.device
    grid = None
    part_acc = part_ml = info = None
    if part.num_reqs > 0 and part.token_end > part.token_begin:
        grid = (programs, num_kv_heads, 1)
        part_acc = torch.empty((programs, num_heads, head_pad), dtype=torch.float32,
                               device=device)
        part_ml = torch.empty((programs, num_heads, 2), dtype=torch.float32, device=device)
        info = torch.zeros(1 + 3 * (programs - part.num_reqs), dtype=torch.int32,
                           device=device)
    stride_cs = num_kv_heads * head_size
    return PreparedLaunch(
        grid=grid,
        qsl=query_start_loc[part.req_begin : part.req_end + 1],
        seq_lens=seq_lens[part.req_begin : part.req_end],
        block_table=table,
        part_acc=part_acc,
        part_ml=part_ml,
        info=info,
        num_reqs=part.num_reqs,
        token_begin=part.token_begin,
        num_tokens=part.token_end - part.token_begin,
        static_args=(
            num_blocks * block_size * stride_cs, block_size * stride_cs, stride_cs,
            head_size, table.stride(0),
        ),
        constexprs={
            "HEAD_SIZE": head_size,
            "HEAD_PAD": head_pad,
            "BLOCK_SIZE": block_size,
            "QPK": qpk,
            "BLOCK_M": max(16, triton.next_power_of_2(qpk)),
            "TILE_N": cfg.tile_n,
            "USE_ALIBI": use_alibi,
            "USE_SOFTCAP": logits_soft_cap is not None,
            "USE_WINDOW": sliding_window is not None,
            "DOT_FP32": interpreting() or dtype == torch.float32,
            "OFF32": cfg.int32_offsets and math.prod(kv_cache_shape) < 2**31,
            "MIN_TILES": max(1, part.min_segment_tokens // cfg.tile_n),
            "REQ_PAD": triton.next_power_of_2(max(part.num_reqs, 2)),
            "HEADS_FIRST": heads_first,
            "ROUND_ROBIN": round_robin,
            "KV_FP8": kv_fp8,
            "USE_SINKS": use_sinks,
            "KV_CVT": kv_convert(cfg, kv_fp8=kv_fp8, itemsize=dtype.itemsize,
                                 interpreting=interpreting()),
            "num_warps": cfg.num_warps,
            "num_stages": cfg.num_stages,
        },
    )


def run_balanced(
    launch: PreparedLaunch,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    output: torch.Tensor,
    *,
    scale: float,
    alibi_slopes: torch.Tensor | None,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    sinks: torch.Tensor,
) -> None:
    """`run_launch` of a balanced part: the decode, then the merge of the split requests."""
    grid, info = launch.grid, launch.info
    assert grid is not None and info is not None
    assert launch.part_acc is not None and launch.part_ml is not None
    v_offset, stride_cb, stride_cs, stride_ch, stride_bt = launch.static_args
    programs, num_kv_heads, _ = grid
    c = launch.constexprs
    kernel_grid = (num_kv_heads, programs) if c["HEADS_FIRST"] else (programs, num_kv_heads)
    balanced_decode_kernel[kernel_grid](
        output, query, kv_cache, v_offset, launch.block_table, launch.seq_lens, launch.qsl,
        query if alibi_slopes is None else alibi_slopes, launch.part_acc, launch.part_ml, info,
        k_scale, v_scale, sinks, launch.num_reqs, scale,
        1.0 if logits_soft_cap is None else logits_soft_cap,
        0 if sliding_window is None else sliding_window, query.stride(0), query.stride(1),
        output.stride(0), output.stride(1), stride_cb, stride_cs, stride_ch, stride_bt,
        **c,
    )
    balanced_merge_kernel[(grid[0] - launch.num_reqs, query.shape[1])](
        output, launch.part_acc, launch.part_ml, info, launch.qsl, output.stride(0),
        output.stride(1), HEAD_SIZE=c["HEAD_SIZE"], HEAD_PAD=c["HEAD_PAD"], SEG_CHUNK=16,
        num_warps=4,
    )
