# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Cascade attention: the shared prefix attended once for every query, and the merge.

`cascade_prefix_kernel` walks the step's shared prefix blocks (one block-table row: every
request holds the same physical blocks there) with *all* query rows of a KV head as the M
dimension (``T * QPK`` rows, in tiles of ``BLOCK_M``: a dense GQA-packed tile over every
request's queries), so each prefix K/V tile is read once per M tile instead of once per
request; the prefix is split over ``NUM_SEGMENTS`` programs per tile so that the launch fills
the GPU. No causal mask: every query lies after the prefix. It writes split-KV partials
``(acc, max, sum)`` in base 2, the layout `paged_attention_kernel`'s segments use. An unsplit
suffix launch folds them into its own state before writing the output (its
``PREFIX_SEGMENTS``); after a split suffix launch `cascade_merge_kernel` combines both sets.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedcore_triton.kernels.attention import (
    _attend_tile,
    _fold_partials,
    _load_q,
    _store_partials,
)

__all__ = ["cascade_merge_kernel", "cascade_prefix_kernel"]


@triton.jit
def cascade_prefix_kernel(
    q_ptr,
    k_cache_ptr,
    v_offset,
    prefix_blocks_ptr,
    part_acc_ptr,
    part_ml_ptr,
    num_tokens,
    prefix_len,
    prefix_len_ptr,
    scale,
    soft_cap,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QPK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_FP32: tl.constexpr,
    STAGES: tl.constexpr = 3,
    PREFIX_FROM_PTR: tl.constexpr = False,
):
    """Grid ``(cdiv(T * QPK, BLOCK_M), Hkv, NUM_SEGMENTS)``; partials ``[T, Hq, S, HEAD_PAD]``
    and ``[T, Hq, S, 2]`` float32 (row ``r`` of a KV head is token ``r // QPK``, query head
    ``kv_head * QPK + r % QPK``).

    Segment ``s`` walks an equal share of the prefix's ``TILE_N``-token tiles: the tiles
    inside the prefix without masks (software-pipelined over `STAGES` stages), the last,
    partial one (a prefix ends on a block, not on a tile) masked. A segment left without
    tiles marks its rows empty (max -inf), which weigh nothing in the merge.

    With ``PREFIX_FROM_PTR`` the prefix length is read from ``prefix_len_ptr`` (a ``[1]``
    int32 device scalar: the CUDA-graph cascade, whose launch is captured once for a bucket)
    and `prefix_len` is only the capacity the grid was sized for; segments split the *real*
    prefix's tiles, so a shorter prefix leaves trailing segments empty (they exit early)."""
    if PREFIX_FROM_PTR:
        prefix_len = tl.load(prefix_len_ptr)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // QPK
    head = kv_head * QPK + rows % QPK
    row_ok = tok < num_tokens
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_SIZE
    q_rows = tok.to(tl.int64)
    prow = (q_rows * (QPK * tl.num_programs(1)) + head) * NUM_SEGMENTS + segment
    tiles = tl.cdiv(prefix_len, TILE_N)
    per_segment = tl.cdiv(tiles, NUM_SEGMENTS)
    t_start = segment * per_segment
    t_stop = tl.minimum(t_start + per_segment, tiles)
    if t_start >= t_stop:
        tl.store(part_ml_ptr + prow * 2, tl.full([BLOCK_M], float("-inf"), tl.float32),
                 mask=row_ok)
        return
    q = _load_q(q_ptr, q_rows, head, d, row_ok, d_ok, stride_qt, stride_qh, DOT_FP32)
    qk_scale = scale * 1.4426950408889634
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    slope = tl.zeros([BLOCK_M], tl.float32)
    pos_q = tl.zeros([BLOCK_M], tl.int32)  # unused: no causal mask, no ALiBi, no window
    kv_head_off = kv_head.to(tl.int64) * stride_ch
    v_cache_ptr = k_cache_ptr + v_offset
    full_stop = tl.minimum(t_stop, prefix_len // TILE_N)  # tiles wholly inside the prefix
    for t in tl.range(t_start, full_stop, num_stages=STAGES):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, t, prefix_blocks_ptr, k_cache_ptr, v_cache_ptr, kv_head_off,
            stride_cb, stride_cs, d, d_ok, row_ok, pos_q, 0, prefix_len, slope, scale,
            qk_scale, soft_cap, 0, HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, TILE_N, False, False,
            USE_SOFTCAP, False, DOT_FP32, False,
        )
    for t in range(tl.maximum(t_start, full_stop), t_stop):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, t, prefix_blocks_ptr, k_cache_ptr, v_cache_ptr, kv_head_off,
            stride_cb, stride_cs, d, d_ok, row_ok, pos_q, 0, prefix_len, slope, scale,
            qk_scale, soft_cap, 0, HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, TILE_N, False, False,
            USE_SOFTCAP, False, DOT_FP32, True,
        )
    _store_partials(part_acc_ptr, part_ml_ptr, acc, m_i, l_i, prow, d, row_ok, HEAD_PAD)


@triton.jit
def cascade_merge_kernel(
    out_ptr,
    sfx_acc_ptr,
    sfx_ml_ptr,
    pfx_acc_ptr,
    pfx_ml_ptr,
    num_heads,
    stride_ot,
    stride_oh,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    SUFFIX_SEGMENTS: tl.constexpr,
    PREFIX_SEGMENTS: tl.constexpr,
):
    """Grid ``(T,)``: the log-sum-exp merge of a split suffix launch's partials and the
    prefix's, all query heads of one token per program (only when the suffix launch splits;
    an unsplit one merges the prefix itself, ``PREFIX_SEGMENTS`` of
    `paged_attention_kernel`)."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.arange(0, HEADS_PAD)
    row_ok = head < num_heads
    d = tl.arange(0, HEAD_PAD)
    m_i = tl.full([HEADS_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([HEADS_PAD], tl.float32)
    acc = tl.zeros([HEADS_PAD, HEAD_PAD], tl.float32)
    row = tok * num_heads + head
    m_i, l_i, acc = _fold_partials(sfx_acc_ptr, sfx_ml_ptr, m_i, l_i, acc,
                                   row * SUFFIX_SEGMENTS, d, row_ok, HEAD_PAD, SUFFIX_SEGMENTS)
    m_i, l_i, acc = _fold_partials(pfx_acc_ptr, pfx_ml_ptr, m_i, l_i, acc,
                                   row * PREFIX_SEGMENTS, d, row_ok, HEAD_PAD, PREFIX_SEGMENTS)
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (d < HEAD_SIZE)[None, :])
