"""Launchers of the Triton kernels (importing this module imports triton).

A launch is prepared once per step and layer shape (`prepare_launch`: slices of the step's
tensors, grid, tile shape, split-KV scratch) and then run once per layer (`run_launch`), so
the per-layer host work is one or two kernel launches. Nothing here reads device values: a
prepared launch stays valid while the step's buffers are rewritten in place (CUDA graphs).
"""

from __future__ import annotations

import math
import os

import torch
import triton

from pagedcore_triton._env import interpreting
from pagedcore_triton.kernels.attention import merge_segments_kernel, paged_attention_kernel
from pagedcore_triton.kernels.cache_write import write_kv_cache
from pagedcore_triton.kernels.decode_fp8 import fp8_decode_kernel
from pagedcore_triton.launch import PreparedLaunch, cache_strides, part_tensors
from pagedcore_triton.ops_balanced import prepare_balanced, run_balanced
from pagedcore_triton.plan import (
    PREFILL_TILES_ENV,
    LaunchPart,
    TileConfig,
    flat_grid_size,
    kv_convert,
    tile_config,
)

__all__ = ["PreparedLaunch", "paged_attention", "prepare_launch", "run_launch", "write_kv_cache"]


def prepare_launch(
    part: LaunchPart,
    *,
    query_shape: tuple[int, int, int],
    dtype: torch.dtype,
    kv_cache_shape: tuple[int, ...],
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    causal: bool,
    use_alibi: bool,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    tiles: TileConfig | None = None,
    kv_fp8: bool = False,
    use_sinks: bool = False,
) -> PreparedLaunch:
    """Plan one launch of `paged_attention_kernel` for `part` (see `paged_attention`)."""
    _, _, block_size, num_kv_heads, head_size = kv_cache_shape
    num_heads = query_shape[1]
    qpk = num_heads // num_kv_heads
    interp = interpreting()
    cfg = tiles or tile_config(
        part.max_query_len, qpk, head_size, interpreting=interp,
        prefill_override=os.environ.get(PREFILL_TILES_ENV), prefill_only=part.prefill_only,
        itemsize=dtype.itemsize, kv_itemsize=1 if kv_fp8 else dtype.itemsize,
    )
    head_pad = triton.next_power_of_2(head_size)
    if part.balanced_programs is not None:
        return prepare_balanced(
            part, cfg, num_heads=num_heads, head_pad=head_pad, dtype=dtype,
            kv_cache_shape=kv_cache_shape, query_start_loc=query_start_loc,
            seq_lens=seq_lens, block_table=block_table, use_alibi=use_alibi,
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
            kv_fp8=kv_fp8, use_sinks=use_sinks,
        )
    segments = part.num_segments
    if segments & (segments - 1):
        raise ValueError(f"num_segments must be a power of two, got {segments}")
    num_tokens = part.token_end - part.token_begin
    views = part_tensors(part, query_start_loc, seq_lens, block_table)
    if (cfg.fp8_decode and kv_fp8 and part.max_query_len == 1 and part.flat_programs is None
            and causal and not use_alibi and sliding_window is None
            and logits_soft_cap is None):
        return _prepare_fp8_decode(part, cfg, views, num_heads=num_heads, head_pad=head_pad,
                                   kv_cache_shape=kv_cache_shape, use_sinks=use_sinks,
                                   f32=interp or dtype == torch.float32)
    grid = None
    flat = part.flat_programs is not None
    if part.num_reqs > 0 and num_tokens > 0 and part.flat_programs is not None:
        programs = flat_grid_size(
            num_tokens=num_tokens, num_reqs=part.num_reqs, block_q=cfg.block_q,
            num_segments=segments, target_programs=part.flat_programs,
        )
        grid = (programs, num_kv_heads, 1)
    elif part.num_reqs > 0 and num_tokens > 0:
        grid = (
            part.token_end // cfg.block_q - part.token_begin // cfg.block_q + part.num_reqs,
            num_kv_heads,
            segments,
        )
    part_acc = part_ml = None
    if segments > 1 and grid is not None:
        device = query_start_loc.device
        part_acc = torch.empty(
            (num_tokens, num_heads, segments, head_pad), dtype=torch.float32, device=device
        )
        part_ml = torch.empty(
            (num_tokens, num_heads, segments, 2), dtype=torch.float32, device=device
        )
    return PreparedLaunch(
        grid=grid,
        **views,
        part_acc=part_acc,
        part_ml=part_ml,
        num_reqs=part.num_reqs,
        token_begin=part.token_begin,
        num_tokens=num_tokens,
        # (v_offset, stride_cb, stride_cs, stride_ch, stride_bt); the impl checks that the
        # cache is contiguous.
        static_args=(*cache_strides(kv_cache_shape), views["block_table"].stride(0)),
        constexprs={
            "HEAD_SIZE": head_size,
            "HEAD_PAD": head_pad,
            "BLOCK_SIZE": block_size,
            "QPK": qpk,
            "BLOCK_Q": cfg.block_q,
            "BLOCK_M": cfg.block_m,
            "TILE_N": cfg.tile_n,
            "CAUSAL": causal,
            "USE_ALIBI": use_alibi,
            "USE_SOFTCAP": logits_soft_cap is not None,
            "USE_WINDOW": sliding_window is not None,
            "NUM_SEGMENTS": segments,
            "DOT_FP32": interp or dtype == torch.float32,
            "SKIP_INTERIOR_MASKS": cfg.skip_interior_masks,
            "LONGEST_FIRST": cfg.longest_first,
            "EDGE_STAGES": 1 if cfg.unpipelined_edges else None,
            "OFF32": cfg.int32_offsets and math.prod(kv_cache_shape) < 2**31,
            "FLAT": flat,
            "MIN_SEGMENT_TILES": max(1, part.min_segment_tokens // cfg.tile_n),
            "REQ_PAD": triton.next_power_of_2(part.num_reqs + 1) if flat else 1,
            "KV_FP8": kv_fp8,
            "USE_SINKS": use_sinks,
            "KV_CVT": kv_convert(cfg, kv_fp8=kv_fp8, itemsize=dtype.itemsize, interpreting=interp),
            "num_warps": cfg.num_warps,
            "num_stages": cfg.num_stages,
            **({} if cfg.maxnreg is None else {"maxnreg": cfg.maxnreg}),
        },
    )


def _prepare_fp8_decode(
    part: LaunchPart, cfg: TileConfig, views: dict[str, torch.Tensor], *, num_heads: int,
    head_pad: int, kv_cache_shape: tuple[int, ...], use_sinks: bool, f32: bool,
) -> PreparedLaunch:
    """A launch of `fp8_decode_kernel` (``kernels/decode_fp8.py``) for a part of single-token
    decodes over an fp8 cache: grid ``(requests, Hkv, segments)``."""
    _, _, block_size, num_kv_heads, head_size = kv_cache_shape
    qpk = num_heads // num_kv_heads
    segments = part.num_segments
    num_tokens = part.token_end - part.token_begin
    rows = triton.next_power_of_2(qpk)
    rows = max(rows, cfg.fp8_rows if cfg.fp8_decode != 2 else 1)
    if cfg.fp8_decode != 2:
        rows = max(rows, 16 if f32 else 8)  # the smallest dot (8 rows on the GPU only)
    grid = (part.num_reqs, num_kv_heads, segments) if part.num_reqs and num_tokens else None
    part_acc = part_ml = None
    if segments > 1 and grid is not None:
        device = views["qsl"].device
        part_acc = torch.empty((num_tokens, num_heads, segments, head_pad), dtype=torch.float32,
                               device=device)
        part_ml = torch.empty((num_tokens, num_heads, segments, 2), dtype=torch.float32,
                              device=device)
    return PreparedLaunch(
        grid=grid, **views, part_acc=part_acc, part_ml=part_ml, num_reqs=part.num_reqs,
        token_begin=part.token_begin, num_tokens=num_tokens,
        static_args=(*cache_strides(kv_cache_shape), views["block_table"].stride(0)),
        constexprs={
            "HEAD_SIZE": head_size, "HEAD_PAD": head_pad, "BLOCK_SIZE": block_size,
            "QPK": qpk, "BLOCK_M": rows, "TILE_N": cfg.tile_n, "NUM_SEGMENTS": segments,
            "MODE": cfg.fp8_decode, "USE_SINKS": use_sinks, "F32": f32,
            "OFF32": cfg.int32_offsets and math.prod(kv_cache_shape) < 2**31,
            "KV_FP8": True, "PREFETCH": cfg.fp8_prefetch,
            "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
            **({} if cfg.maxnreg is None else {"maxnreg": cfg.maxnreg}),
        },
        kernel="fp8_decode",
    )


def _run_fp8_decode(launch: PreparedLaunch, query: torch.Tensor, kv_cache: torch.Tensor,
                    output: torch.Tensor, *, scale: float, k_scale: torch.Tensor,
                    v_scale: torch.Tensor, sinks: torch.Tensor, merge: bool) -> None:
    """Run a launch prepared by `_prepare_fp8_decode` (and its split-KV merge)."""
    assert launch.grid is not None
    v_offset, stride_cb, stride_cs, stride_ch, stride_bt = launch.static_args
    part_acc = output if launch.part_acc is None else launch.part_acc
    part_ml = output if launch.part_ml is None else launch.part_ml
    fp8_decode_kernel[launch.grid](
        output, query, kv_cache, v_offset, launch.block_table, launch.seq_lens, launch.qsl,
        part_acc, part_ml, k_scale, v_scale, sinks, launch.token_begin, scale,
        query.stride(0), query.stride(1), output.stride(0), output.stride(1),
        stride_cb, stride_cs, stride_ch, stride_bt, **launch.constexprs,
    )
    if launch.part_acc is not None and merge:
        c = launch.constexprs
        merge_segments_kernel[(launch.num_tokens, query.shape[1])](
            output, launch.part_acc, part_ml, launch.token_begin, output.stride(0),
            output.stride(1), launch.qsl, launch.num_reqs, launch.grid[0],
            HEAD_SIZE=c["HEAD_SIZE"], HEAD_PAD=c["HEAD_PAD"], NUM_SEGMENTS=c["NUM_SEGMENTS"],
            num_warps=4,
        )


def run_launch(
    launch: PreparedLaunch,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    output: torch.Tensor,
    *,
    scale: float,
    alibi_slopes: torch.Tensor | None,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    sinks: torch.Tensor | None = None,
    merge: bool = True,
    prefix_partials: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Run a prepared launch for one layer (see `paged_attention` for the tensors).

    ``merge=False`` leaves a split launch's partials unmerged in ``launch.part_acc`` /
    ``launch.part_ml`` (cascade attention merges them with the prefix's).
    `prefix_partials` (cascade attention, an unsplit classic-grid launch only): the shared
    prefix's ``[T, Hq, S, HEAD_PAD]`` / ``[T, Hq, S, 2]`` partials, merged into the output
    by the launch itself.
    """
    grid = launch.grid
    if grid is None:
        return
    if launch.constexprs["KV_FP8"] and kv_scales is None:
        raise ValueError("an fp8 KV cache needs kv_scales=(k_scale, v_scale)")
    if launch.constexprs["USE_SINKS"] and sinks is None:
        raise ValueError("the launch was prepared with sinks; pass sinks=[Hq] float32")
    k_scale, v_scale = (query, query) if kv_scales is None else kv_scales
    if launch.kernel == "fp8_decode":
        _run_fp8_decode(launch, query, kv_cache, output, scale=scale, k_scale=k_scale,
                        v_scale=v_scale, sinks=query if sinks is None else sinks, merge=merge)
        return
    if launch.info is not None:
        run_balanced(launch, query, kv_cache, output, scale=scale, alibi_slopes=alibi_slopes,
                      sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                      k_scale=k_scale, v_scale=v_scale, sinks=query if sinks is None else sinks)
        return
    v_offset, stride_cb, stride_cs, stride_ch, stride_bt = launch.static_args
    part_acc = output if launch.part_acc is None else launch.part_acc
    part_ml = output if launch.part_ml is None else launch.part_ml
    extra = {}
    if prefix_partials is not None:
        if launch.part_acc is not None or launch.constexprs["FLAT"]:
            raise ValueError("prefix_partials need an unsplit classic-grid launch")
        part_acc, part_ml = prefix_partials
        extra["PREFIX_SEGMENTS"] = part_acc.shape[2]
    paged_attention_kernel[grid](
        output,
        query,
        kv_cache,
        v_offset,
        launch.block_table,
        launch.seq_lens,
        launch.qsl,
        query if alibi_slopes is None else alibi_slopes,
        part_acc,
        part_ml,
        k_scale,
        v_scale,
        query if sinks is None else sinks,
        launch.num_reqs,
        launch.token_begin,
        scale,
        1.0 if logits_soft_cap is None else logits_soft_cap,
        0 if sliding_window is None else sliding_window,
        query.stride(0),
        query.stride(1),
        output.stride(0),
        output.stride(1),
        stride_cb,
        stride_cs,
        stride_ch,
        stride_bt,
        **launch.constexprs,
        **extra,
    )
    if launch.part_acc is not None and merge:
        c = launch.constexprs
        merge_segments_kernel[(launch.num_tokens, query.shape[1])](
            output,
            launch.part_acc,
            part_ml,
            launch.token_begin,
            output.stride(0),
            output.stride(1),
            launch.qsl,
            launch.num_reqs,
            grid[0],
            HEAD_SIZE=c["HEAD_SIZE"],
            HEAD_PAD=c["HEAD_PAD"],
            NUM_SEGMENTS=c["NUM_SEGMENTS"],
            BLOCK_Q=c["BLOCK_Q"],
            FLAT=c["FLAT"],
            REQ_PAD=c["REQ_PAD"],
            num_warps=4,
        )


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    output: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    part: LaunchPart,
    scale: float,
    causal: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    tiles: TileConfig | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Attention for the requests of `part`, written into `output` (prepare + run, once).

    Parameters
    ----------
    query:
        ``[T, Hq, D]`` fp16/bf16/fp32, last dimension contiguous.
    kv_cache:
        ``[2, num_blocks, block_size, Hkv, D]`` contiguous, same dtype as `query`, or fp8
        (``float8_e4m3fn`` / ``float8_e5m2``) with `kv_scales`.
    output:
        ``[T, Hq, D]``, last dimension contiguous; rows of `part`'s tokens are written.
    query_start_loc:
        ``[B + 1]`` int32; ``seq_lens`` ``[B]`` int32; ``block_table`` ``[B, max_blocks]`` int32.
    part:
        Which requests, how many split-KV segments (from the metadata builder).
    scale:
        Softmax scale.
    causal:
        Causal mask aligned to the end of each sequence.
    alibi_slopes:
        ``[Hq]`` float32 or None.
    sliding_window:
        Window ``W`` (a key is visible iff ``pos_q - pos_k < W``) or None.
    logits_soft_cap:
        Cap ``c`` of ``c * tanh(s / c)`` or None.
    tiles:
        Tile shape override (for tuning); None picks `tile_config`'s.
    kv_scales:
        ``(k_scale, v_scale)``, each ``[1]`` float32 on the device: an fp8 cache is read as
        ``fp8 * scale``. Required for (and only read with) an fp8 cache.
    sinks:
        ``[Hq]`` float32 attention-sink logits, or None.
    """
    launch = prepare_launch(
        part,
        query_shape=(query.shape[0], query.shape[1], query.shape[2]),
        dtype=query.dtype,
        kv_cache_shape=tuple(kv_cache.shape),
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table=block_table,
        causal=causal,
        use_alibi=alibi_slopes is not None,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        tiles=tiles,
        kv_fp8=kv_cache.dtype.itemsize == 1,
        use_sinks=sinks is not None,
    )
    run_launch(
        launch,
        query,
        kv_cache,
        output,
        scale=float(scale),
        alibi_slopes=alibi_slopes,
        sliding_window=None if sliding_window is None else int(sliding_window),
        logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        kv_scales=kv_scales,
        sinks=sinks,
    )
