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
    "_clock",
    "_load_cols",
    "_now",
    "_peer_cols",
    "_rows_of_tile",
    "_scores",
    "_smid",
    "_store_cols",
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
