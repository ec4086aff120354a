"""Launchers of the Hopper prefill kernel (``kernels/prefill_tma.py``; imports triton).

`prepare_tma` plans a part's launch once per step and layer shape (grid, tiles, the cache's
strides); `run_tma` builds the two tensor descriptors over the layer's `key` / `value` (they
change from layer to layer) and launches.
"""

from __future__ import annotations

import math
import os

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from pagedcore_triton._env import interpreting
from pagedcore_triton.kernels.prefill_tma import (
    prefill_tma_kernel,
    prefill_tma_ws_kernel,
    prefill_tma_ws_persistent_kernel,
)
from pagedcore_triton.launch import PreparedLaunch, cache_strides, part_tensors
from pagedcore_triton.plan import LaunchPart, TileConfig
from pagedcore_triton.plan_tma import TMA_TILES_ENV, packed_tile_config, tma_tile_config

__all__ = ["prepare_tma", "run_tma"]


def prepare_tma(
    part: LaunchPart,
    *,
    num_heads: int,
    dtype: torch.dtype,
    kv_cache_shape: tuple[int, ...],
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    causal: bool,
    tiles: TileConfig | None = None,
) -> PreparedLaunch:
    """Plan `part` (a prefill-only part, `LaunchPart.tma_prefill`) on the Hopper kernel.

    The tensors are the step's (see `pagedcore_triton.ops.paged_attention`); `tiles`
    overrides `tma_tile_config`'s choice (tuning)."""
    _, _, block_size, num_kv_heads, head_size = kv_cache_shape
    qpk = num_heads // num_kv_heads
    interp = interpreting()
    cfg = tiles or tma_tile_config(qpk, head_size, interpreting=interp,
                                   override=os.environ.get(TMA_TILES_ENV),
                                   has_context=part.has_context)
    views = part_tensors(part, query_start_loc, seq_lens, block_table)
    if cfg.tma_ws and part.has_context:  # the GQA-packed kernel reads the prefix
        cfg = packed_tile_config(qpk, head_size, interpreting=interp)
    if cfg.tma_ws:
        return _prepare_ws(part, cfg, views, num_heads=num_heads, qpk=qpk,
                           head_size=head_size, causal=causal,
                           dot_fp32=interp or dtype == torch.float32, interp=interp)
    grid = None
    # The grid's axis 1 holds at most 65535 programs.
    heads_fast = cfg.heads_fast
    if part.num_reqs > 0 and part.token_end > part.token_begin:
        q_blocks = part.token_end // cfg.block_q - part.token_begin // cfg.block_q
        heads_fast = heads_fast and q_blocks + part.num_reqs <= 65535
        grid = ((num_kv_heads, q_blocks + part.num_reqs, 1) if heads_fast
                else (q_blocks + part.num_reqs, num_kv_heads, 1))
    edge_stages = 1 if cfg.unpipelined_edges else cfg.num_stages
    return PreparedLaunch(
        grid=grid,
        **views,
        part_acc=None,
        part_ml=None,
        num_reqs=part.num_reqs,
        token_begin=part.token_begin,
        num_tokens=part.token_end - part.token_begin,
        # The cache is contiguous (checked by the impl).
        static_args=(*cache_strides(kv_cache_shape), views["block_table"].stride(0),
                     part.token_end),
        constexprs={
            "HEAD_SIZE": head_size,
            "BLOCK_SIZE": block_size,
            "QPK": qpk,
            "BLOCK_Q": cfg.block_q,
            "BLOCK_M": cfg.block_m,
            "TILE_N": cfg.tile_n,
            "CAUSAL": causal,
            "HAS_PREFIX": part.has_context,
            "DOT_FP32": interp or dtype == torch.float32,
            "LONGEST_FIRST": cfg.longest_first,
            "OFF32": math.prod(kv_cache_shape) < 2**31,
            "INNER_STAGES": cfg.num_stages,
            "EDGE_STAGES": edge_stages,
            "WARP_SPECIALIZE": cfg.warp_specialize,
            "DIAG_N": cfg.diag_tile_n if causal else 0,
            "HEADS_FAST": heads_fast,
            "num_warps": cfg.num_warps,
            "num_stages": cfg.num_stages,
            # A cached prefix's gather (`_attend_tile`) spills under a register cap.
            **({} if cfg.maxnreg is None or interp or part.has_context
               else {"maxnreg": cfg.maxnreg}),
        },
    )


def _prepare_ws(part: LaunchPart, cfg: TileConfig, views: dict[str, torch.Tensor], *,
                num_heads: int, qpk: int, head_size: int, causal: bool, dot_fp32: bool,
                interp: bool) -> PreparedLaunch:
    """`prepare_tma` for the warp-specialized kernel (a part without a cached prefix)."""
    grid = None
    heads_fast = cfg.heads_fast
    q_blocks = 0
    if part.num_reqs > 0 and part.token_end > part.token_begin:
        # The request search counts one spare q-block per request (`_ws_q_block`).
        q_blocks = part.token_end // cfg.block_m - part.token_begin // cfg.block_m
        q_blocks += part.num_reqs
        heads_fast = heads_fast and q_blocks <= 65535
        grid = ((num_heads, q_blocks, 1) if heads_fast else (q_blocks, num_heads, 1))
        if cfg.persistent:
            grid = (min(_programs_per_device(views["qsl"].device, interp),
                        num_heads * q_blocks), 1, 1)
    ws = {"WARP_SPECIALIZE": not interp}
    if not cfg.persistent:
        ws["HEADS_FAST"] = heads_fast
    return PreparedLaunch(
        grid=grid,
        **views,
        part_acc=None,
        part_ml=None,
        num_reqs=part.num_reqs,
        token_begin=part.token_begin,
        num_tokens=part.token_end - part.token_begin,
        static_args=("ws", part.token_end, num_heads, q_blocks, cfg.persistent),
        constexprs={
            "HEAD_SIZE": head_size,
            "QPK": qpk,
            "BLOCK_M": cfg.block_m,
            "TILE_N": cfg.tile_n,
            "CAUSAL": causal,
            "DOT_FP32": dot_fp32,
            "SEARCH_STEPS": max(1, part.num_reqs.bit_length()),
            "STAGES": cfg.num_stages,
            **ws,
            "num_warps": cfg.num_warps,
            "num_stages": cfg.num_stages,
            **({} if cfg.maxnreg is None or interp else {"maxnreg": cfg.maxnreg}),
        },
    )


#: Programs of a persistent launch in the interpreter (no device to size it by): a few, so
#: that each loops over several q-blocks.
INTERPRETER_PROGRAMS = 3


def _programs_per_device(device: torch.device, interp: bool) -> int:
    """Programs of a persistent launch: one per SM (its ~200 KB of shared memory fit one)."""
    if interp or device.type != "cuda":
        return INTERPRETER_PROGRAMS
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _tma_rows(t: torch.Tensor) -> bool:
    """Whether ``[T, H, D]`` `t` can be a 2-D ``[T, H * D]`` tensor descriptor."""
    return (t.stride(2) == 1 and t.stride(1) == t.shape[2] and t.data_ptr() % 16 == 0
            and (t.stride(0) * t.element_size()) % 16 == 0)


def _run_ws(launch: PreparedLaunch, query: torch.Tensor, key: torch.Tensor,
            value: torch.Tensor, output: torch.Tensor, *, scale: float) -> None:
    grid = launch.grid
    assert grid is not None
    _, token_end, num_heads, q_blocks, persistent = launch.static_args
    c = launch.constexprs
    if not _tma_rows(query):
        query = query.contiguous()
    width = key.shape[1] * key.shape[2]
    box = [c["TILE_N"], c["HEAD_SIZE"]]
    k_desc = TensorDescriptor(key, [token_end, width], [key.stride(0), 1], box)
    v_desc = TensorDescriptor(value, [token_end, width], [value.stride(0), 1], box)
    _ensure_allocator()
    args = (output, query, k_desc, v_desc, launch.qsl, launch.num_reqs, scale, token_end,
            query.shape[1] * query.shape[2], query.stride(0), output.stride(0),
            output.stride(1))
    if persistent:
        prefill_tma_ws_persistent_kernel[grid](*args, num_heads, q_blocks, **c)
    else:
        prefill_tma_ws_kernel[grid](*args, **c)


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    """The warp-specialized kernel builds its query descriptor on the device, in global
    scratch memory from Triton's allocator: install one (torch's) unless the caller did."""
    from triton.runtime import _allocation

    current = getattr(_allocation, "_allocator", None)
    null = getattr(_allocation, "NullAllocator", None)
    if current is None or null is None or isinstance(current.get(), null):
        triton.set_allocator(_scratch)


def run_tma(
    launch: PreparedLaunch,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    output: torch.Tensor,
    *,
    scale: float,
) -> None:
    """Run a prepared Hopper-kernel launch for one layer.

    `query` / `output` ``[T, Hq, D]`` (last dimension contiguous), `key` / `value`
    ``[>= token_end, Hkv, D]`` this step's own K/V (`plan_tma.tma_layer_reason` holds), the
    paged `kv_cache` for cached prefixes."""
    grid = launch.grid
    if grid is None:
        return
    if launch.static_args[0] == "ws":
        _run_ws(launch, query, key, value, output, scale=scale)
        return
    v_offset, stride_cb, stride_cs, stride_ch, stride_bt, token_end = launch.static_args
    c = launch.constexprs
    width = key.shape[1] * key.shape[2]
    box = [c["TILE_N"], c["HEAD_SIZE"]]
    k_desc = TensorDescriptor(key, [token_end, width], [key.stride(0), 1], box)
    v_desc = TensorDescriptor(value, [token_end, width], [value.stride(0), 1], box)
    kd_desc, vd_desc = k_desc, v_desc
    if c["DIAG_N"]:
        box = [c["DIAG_N"], c["HEAD_SIZE"]]
        kd_desc = TensorDescriptor(key, [token_end, width], [key.stride(0), 1], box)
        vd_desc = TensorDescriptor(value, [token_end, width], [value.stride(0), 1], box)
    prefill_tma_kernel[grid](
        output,
        query,
        k_desc,
        v_desc,
        kd_desc,
        vd_desc,
        kv_cache,
        v_offset,
        launch.block_table,
        launch.seq_lens,
        launch.qsl,
        launch.num_reqs,
        scale,
        query.stride(0),
        query.stride(1),
        output.stride(0),
        output.stride(1),
        stride_cb,
        stride_cs,
        stride_ch,
        stride_bt,
        **c,
    )
