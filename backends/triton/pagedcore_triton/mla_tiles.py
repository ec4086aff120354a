# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Tile-level helpers of the Triton MLA decode kernel (`pagedcore_triton.mla_kernels`).

Row addresses of a tile of cache positions (through the block table), masked
loads of latent / rope columns, the score and PV MMAs, the stores of accumulator columns,
the fused merge's peer reads, and the ``PROBE`` build's timers (``%globaltimer``,
``%clock64``, ``%smid``).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "_accumulate",
    "_attend",
    "_clock",
    "_load_cols",
    "_now",
    "_peer_cols",
    "_queries",
    "_rows_of_tile",
    "_scores",
    "_smid",
    "_store_cols",
    "_store_partial",
    "_store_scaled",
    "_to_f16",
    "_weight",
]


@triton.jit
def _rows_of_tile(table_row, n0, end, stride_cb, stride_cs, BLOCK_SIZE: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """Element offsets ``[BLOCK_N]`` (int64) of the cache rows of positions ``n0 + i``, and
    the mask of the positions before `end`. (One block-table entry per position: loading one
    per block and reshaping kept Triton 3.6 from pipelining the row loads.)"""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < end
    blk = tl.load(table_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
    row = blk.to(tl.int64) * stride_cb + (offs_n % BLOCK_SIZE).to(tl.int64) * stride_cs
    return row, n_mask


@triton.jit
def _load_cols(base_ptr, row, n_mask, col0, valid, WIDTH: tl.constexpr, PADDED: tl.constexpr):
    """``[len(row), WIDTH]`` values at columns ``col0 + j`` of each row; zero where masked
    (rows past the end, and with `PADDED` columns from `valid` on)."""
    offs = col0 + tl.arange(0, WIDTH)
    ptrs = base_ptr + row[:, None] + offs[None, :]
    if PADDED:
        out = tl.load(ptrs, mask=n_mask[:, None] & (offs < valid)[None, :], other=0.0)
    else:
        out = tl.load(ptrs, mask=n_mask[:, None], other=0.0)
    return out


@triton.jit
def _now():
    """The GPU's global nanosecond timer (``%globaltimer``); `PROBE` launches only."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _clock():
    """This SM's cycle counter (``%clock64``); `PROBE` launches only."""
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _smid():
    """The SM this program runs on (``%smid``); `PROBE` launches only."""
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _scores(q, k, scale_log2, DOT_FP32: tl.constexpr):
    """``scale_log2 * q @ k^T`` in fp32. The multiply keeps Triton from folding a sum of
    such dots into one accumulator chain, so the chunks' MMAs stay independent."""
    if DOT_FP32:  # fp32 caches, and the interpreter (whose bf16 dot is wrong)
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    return s * scale_log2


@triton.jit
def _accumulate(p, c, acc, alpha, DOT_FP32: tl.constexpr):
    """``acc * alpha + p @ c`` (the rescale, then the MMA accumulating in place)."""
    acc = acc * alpha[:, None]
    if DOT_FP32:
        acc = tl.dot(p, c.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(c.dtype), c, acc)
    return acc


@triton.jit
def _store_cols(ptrs, acc, col0, mask_rows, valid, WIDTH: tl.constexpr):
    offs = col0 + tl.arange(0, WIDTH)
    tl.store(ptrs + offs[None, :], acc.to(ptrs.dtype.element_ty),
             mask=mask_rows[:, None] & (offs < valid)[None, :])


@triton.jit
def _store_scaled(ptrs, scale, rows_ok, valid, acc0, acc1, acc2, acc3,
                  LATENT_PAD: tl.constexpr, LAT_SPLIT: tl.constexpr):
    """``acc * scale`` (rows) at ``ptrs + column`` for the ``LAT_SPLIT`` latent chunks of
    ``LATENT_PAD // LAT_SPLIT`` columns, rows `rows_ok` and columns below `valid`."""
    CW: tl.constexpr = LATENT_PAD // LAT_SPLIT
    _store_cols(ptrs, acc0 * scale[:, None], 0, rows_ok, valid, CW)
    if LAT_SPLIT >= 2:
        _store_cols(ptrs, acc1 * scale[:, None], CW, rows_ok, valid, CW)
    if LAT_SPLIT == 4:
        _store_cols(ptrs, acc2 * scale[:, None], 2 * CW, rows_ok, valid, CW)
        _store_cols(ptrs, acc3 * scale[:, None], 3 * CW, rows_ok, valid, CW)


@triton.jit
def _store_partial(part_acc_ptr, part_ml_ptr, part, head_mask, m_i, l_i, acc0, acc1, acc2,
                   acc3, LATENT_PAD: tl.constexpr, LAT_SPLIT: tl.constexpr, value_scale=1.0):
    """One split's partial at rows `part` (``[BLOCK_H]`` indices into ``[T, H, splits]``):
    ``value_scale * acc / sum`` into `part_acc_ptr` ``[..., LATENT_PAD]`` (the merge weighs
    each split by its sum; a non-empty split has a sum >= 1, an empty one ``acc = 0``;
    `value_scale` is an fp8 cache's ``k_scale``) and ``(max, sum)`` into `part_ml_ptr`
    ``[..., 2]``."""
    ptrs = part_acc_ptr + part[:, None] * LATENT_PAD
    scale = value_scale / tl.maximum(l_i, 1.0)
    tl.store(part_ml_ptr + part * 2, m_i, mask=head_mask)
    tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=head_mask)
    _store_scaled(ptrs, scale, head_mask, LATENT_PAD, acc0, acc1, acc2, acc3, LATENT_PAD,
                  LAT_SPLIT)


@triton.jit
def _weight(m, m_new):
    """``exp2(m - m_new)``, and 0 for an empty partial (``m = -inf``, also when all are)."""
    return tl.exp2(tl.where(m > float("-inf"), m - m_new, float("-inf")))


@triton.jit
def _peer_cols(part_acc_ptr, part_ml_ptr, rows, ok, m_new, col0, LATENT_PAD: tl.constexpr,
               WIDTH: tl.constexpr):
    """``w * acc``: the ``[len(rows), WIDTH]`` fp32 partial another program wrote, weighted by
    ``exp2(m - m_new)``; read from L2 (``.cg``), never from this SM's L1; 0 where not `ok`."""
    offs = col0 + tl.arange(0, WIDTH)
    m = tl.load(part_ml_ptr + rows * 2, mask=ok, other=float("-inf"), cache_modifier=".cg")
    acc = tl.load(part_acc_ptr + rows[:, None] * LATENT_PAD + offs[None, :],
                  mask=ok[:, None], other=0.0, cache_modifier=".cg")
    return _weight(m, m_new)[:, None] * acc


@triton.jit
def _queries(q_ptr, tok, heads, head_mask, stride_qt, stride_qh, LATENT: tl.constexpr,
             LATENT_PAD: tl.constexpr, LAT_SPLIT: tl.constexpr, ROPE: tl.constexpr,
             ROPE_PAD: tl.constexpr, DOT_FP32: tl.constexpr, Q_F16: tl.constexpr = False):
    """Token `tok`'s queries for `heads` (rows): ``[BLOCK_H, ROPE_PAD]`` rope and
    ``LAT_SPLIT`` latent chunks ``[BLOCK_H, LATENT_PAD // LAT_SPLIT]`` (unused chunks repeat
    the first); fp32 with `DOT_FP32`; float16 (clamped to +-65504) with `Q_F16`, so that fp8
    cache tiles convert to float16 in one instruction pair instead of via float32 to bf16."""
    CW: tl.constexpr = LATENT_PAD // LAT_SPLIT
    q_row = (tok.to(tl.int64) * stride_qt + heads * stride_qh).to(tl.int64)
    q_pe = _load_cols(q_ptr + LATENT, q_row, head_mask, 0, ROPE, ROPE_PAD, ROPE_PAD != ROPE)
    q0 = _load_cols(q_ptr, q_row, head_mask, 0, LATENT, CW, LATENT_PAD != LATENT)
    q1 = q0
    q2 = q0
    q3 = q0
    if LAT_SPLIT >= 2:
        q1 = _load_cols(q_ptr, q_row, head_mask, CW, LATENT, CW, LATENT_PAD != LATENT)
    if LAT_SPLIT == 4:
        q2 = _load_cols(q_ptr, q_row, head_mask, 2 * CW, LATENT, CW, LATENT_PAD != LATENT)
        q3 = _load_cols(q_ptr, q_row, head_mask, 3 * CW, LATENT, CW, LATENT_PAD != LATENT)
    if DOT_FP32:
        q_pe = q_pe.to(tl.float32)
        q0 = q0.to(tl.float32)
        q1 = q1.to(tl.float32)
        q2 = q2.to(tl.float32)
        q3 = q3.to(tl.float32)
    elif Q_F16:
        q_pe = _to_f16(q_pe)
        q0 = _to_f16(q0)
        q1 = _to_f16(q1)
        q2 = _to_f16(q2)
        q3 = _to_f16(q3)
    return q_pe, q0, q1, q2, q3


@triton.jit
def _to_f16(x):
    """`x` as float16, clamped to float16's finite range."""
    return tl.clamp(x.to(tl.float32), -65504.0, 65504.0).to(tl.float16)


@triton.jit
def _attend(q_pe, q0, q1, q2, q3, cache_ptr, table_row, start, end, stride_cb, stride_cs,
            scale_log2, LATENT: tl.constexpr, LATENT_PAD: tl.constexpr,
            LAT_SPLIT: tl.constexpr, ROPE: tl.constexpr, ROPE_PAD: tl.constexpr,
            BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
            DOT_FP32: tl.constexpr, ROWSUM_2D: tl.constexpr, KV_FP8: tl.constexpr = False):
    """Online softmax over cache positions ``[start, end)`` (tiles of ``BLOCK_N``) of the
    request whose block-table row is `table_row`: ``(m, l, acc0..acc3)``, the base-2 row
    maxima and sums ``[BLOCK_H]`` and the unnormalised latent accumulators ``[BLOCK_H,
    LATENT_PAD // LAT_SPLIT]`` (unused chunks repeat the first). An empty range gives
    ``m = -inf``, ``l = 0`` and zero accumulators.

    With `KV_FP8` the cache holds fp8 rows: each tile is converted to the queries' dtype in
    registers (the caller folds ``k_scale`` into `scale_log2` and into the output)."""
    CW: tl.constexpr = LATENT_PAD // LAT_SPLIT
    LP: tl.constexpr = LATENT_PAD != LATENT
    RP: tl.constexpr = ROPE_PAD != ROPE
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    if ROWSUM_2D:
        l_2d = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_H, CW], dtype=tl.float32)
    if LAT_SPLIT >= 2:
        acc1 = tl.zeros([BLOCK_H, CW], dtype=tl.float32)
    if LAT_SPLIT == 4:
        acc2 = tl.zeros([BLOCK_H, CW], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_H, CW], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        row, n_mask = _rows_of_tile(table_row, n0, end, stride_cb, stride_cs, BLOCK_SIZE,
                                    BLOCK_N)
        k_pe = _load_cols(cache_ptr + LATENT, row, n_mask, 0, ROPE, ROPE_PAD, RP)
        c0 = _load_cols(cache_ptr, row, n_mask, 0, LATENT, CW, LP)
        if KV_FP8:
            k_pe = k_pe.to(q_pe.dtype)
            c0 = c0.to(q0.dtype)
        s = _scores(q_pe, k_pe, scale_log2, DOT_FP32)
        s += _scores(q0, c0, scale_log2, DOT_FP32)
        if LAT_SPLIT >= 2:
            c1 = _load_cols(cache_ptr, row, n_mask, CW, LATENT, CW, LP)
            if KV_FP8:
                c1 = c1.to(q1.dtype)
            s += _scores(q1, c1, scale_log2, DOT_FP32)
        if LAT_SPLIT == 4:
            c2 = _load_cols(cache_ptr, row, n_mask, 2 * CW, LATENT, CW, LP)
            c3 = _load_cols(cache_ptr, row, n_mask, 3 * CW, LATENT, CW, LP)
            if KV_FP8:
                c2 = c2.to(q2.dtype)
                c3 = c3.to(q3.dtype)
            s += _scores(q2, c2, scale_log2, DOT_FP32)
            s += _scores(q3, c3, scale_log2, DOT_FP32)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        if ROWSUM_2D:  # no cross-warp sum per tile: one after the loop
            l_2d = l_2d * alpha[:, None] + p
        else:
            l_i = l_i * alpha + tl.sum(p, axis=1)
        acc0 = _accumulate(p, c0, acc0, alpha, DOT_FP32)
        if LAT_SPLIT >= 2:
            acc1 = _accumulate(p, c1, acc1, alpha, DOT_FP32)
        if LAT_SPLIT == 4:
            acc2 = _accumulate(p, c2, acc2, alpha, DOT_FP32)
            acc3 = _accumulate(p, c3, acc3, alpha, DOT_FP32)
        m_i = m_new
    if ROWSUM_2D:
        l_i = tl.sum(l_2d, axis=1)
    if LAT_SPLIT < 2:
        acc1 = acc0
    if LAT_SPLIT < 4:
        acc2 = acc0
        acc3 = acc0
    return m_i, l_i, acc0, acc1, acc2, acc3
