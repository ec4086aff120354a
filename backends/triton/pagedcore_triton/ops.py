"""Launchers of the Triton kernels (importing this module imports triton)."""

from __future__ import annotations

import torch
import triton

from pagedcore_triton._env import interpreting
from pagedcore_triton.kernels.attention import merge_segments_kernel, paged_attention_kernel
from pagedcore_triton.kernels.cache_write import write_kv_cache
from pagedcore_triton.plan import LaunchPart, TileConfig, tile_config

__all__ = ["paged_attention", "write_kv_cache"]


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
) -> None:
    """Attention for the requests of `part`, written into `output`.

    Parameters
    ----------
    query:
        ``[T, Hq, D]`` fp16/bf16/fp32, last dimension contiguous.
    kv_cache:
        ``[2, num_blocks, block_size, Hkv, D]`` contiguous, same dtype as `query`.
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
    """
    num_reqs = part.num_reqs
    num_tokens = part.token_end - part.token_begin
    if num_reqs == 0 or num_tokens == 0:
        return
    _, _, block_size, num_kv_heads, head_size = kv_cache.shape
    num_heads = query.shape[1]
    qpk = num_heads // num_kv_heads
    interp = interpreting()
    cfg = tiles or tile_config(part.max_query_len, qpk, head_size, interpreting=interp)
    head_pad = triton.next_power_of_2(head_size)
    segments = part.num_segments
    if segments & (segments - 1):
        raise ValueError(f"num_segments must be a power of two, got {segments}")
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    qsl = query_start_loc[part.req_begin : part.req_end + 1]
    lens = seq_lens[part.req_begin : part.req_end]
    table = block_table[part.req_begin : part.req_end]
    if table.stride(-1) != 1:
        table = table.contiguous()
    grid = (
        part.token_end // cfg.block_q - part.token_begin // cfg.block_q + num_reqs,
        num_kv_heads,
        segments,
    )
    if segments > 1:
        part_acc = torch.empty(
            (num_tokens, num_heads, segments, head_pad), dtype=torch.float32, device=query.device
        )
        part_ml = torch.empty(
            (num_tokens, num_heads, segments, 2), dtype=torch.float32, device=query.device
        )
    else:
        part_acc = part_ml = output  # unused
    paged_attention_kernel[grid](
        output,
        query,
        k_cache,
        v_cache,
        table,
        lens,
        qsl,
        query if alibi_slopes is None else alibi_slopes,
        part_acc,
        part_ml,
        num_reqs,
        part.token_begin,
        float(scale),
        1.0 if logits_soft_cap is None else float(logits_soft_cap),
        0 if sliding_window is None else int(sliding_window),
        query.stride(0),
        query.stride(1),
        output.stride(0),
        output.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        table.stride(0),
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size,
        QPK=qpk,
        BLOCK_Q=cfg.block_q,
        BLOCK_M=cfg.block_m,
        TILE_N=cfg.tile_n,
        CAUSAL=causal,
        USE_ALIBI=alibi_slopes is not None,
        USE_SOFTCAP=logits_soft_cap is not None,
        USE_WINDOW=sliding_window is not None,
        NUM_SEGMENTS=segments,
        DOT_FP32=interp or query.dtype == torch.float32,
        SKIP_INTERIOR_MASKS=cfg.skip_interior_masks,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if segments > 1:
        merge_segments_kernel[(num_tokens, num_heads)](
            output,
            part_acc,
            part_ml,
            part.token_begin,
            output.stride(0),
            output.stride(1),
            HEAD_SIZE=head_size,
            HEAD_PAD=head_pad,
            NUM_SEGMENTS=segments,
            num_warps=4,
        )
