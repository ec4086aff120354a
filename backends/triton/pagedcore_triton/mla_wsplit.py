# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""The MLA decode with the score dims split across warps (``MLAKernelConfig.warp_split``).

`pagedcore_triton.mla_kernels.mla_decode_kernel` lets Triton lay its 16-row MMAs out with the
4 warps side by side along the tile's cache positions: each warp scores 8 positions over all
576 dims, so every tile needs a row maximum across warps and the ``p`` tile passed to the
other warps through shared memory (5 barriers per tile in an sm_90 compile), and each warp
reads the whole query from shared memory again.

Here the dims are split across the warps instead, written as batched (3-D) dots whose batch
dimension Triton gives one warp each: warp ``w`` owns latent columns ``[w * CW, (w + 1) *
CW)`` and rope columns ``[w * RW, (w + 1) * RW)`` (``CW = LATENT_PAD / 4``, ``RW = ROPE_PAD /
4``). It scores all positions of the tile over its own columns (its query slice stays in
registers), the four partial scores are summed across warps (one reduction through shared
memory), and then every warp holds the whole score tile: the softmax needs nothing from
the other warps, and ``p`` is already in the warp for the ``p @ c`` MMA over its own latent
columns, the same columns it scored with. Same partials and output as the main kernel, so
the merge kernel is shared.

Needs ``LATENT_PAD >= 64`` and ``ROPE_PAD >= 64`` (every MMA dim at least 16);
`pagedcore_triton.mla.TritonMLAImpl` falls back to the main kernel otherwise.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedcore_triton.mla_tiles import _rows_of_tile

__all__ = ["mla_decode_wsplit_kernel"]


@triton.jit
def _chunk_cols(base_ptr, row, ok_rows, valid, CH: tl.constexpr, WIDTH: tl.constexpr,
                PADDED: tl.constexpr):
    """``[CH, len(row), WIDTH]``: chunk ``w`` holds columns ``w * WIDTH + j`` of each row;
    zero where `ok_rows` is false (and with `PADDED` from column `valid` on)."""
    cols = tl.arange(0, CH)[:, None, None] * WIDTH + tl.arange(0, WIDTH)[None, None, :]
    ptrs = base_ptr + row[None, :, None] + cols
    mask = ok_rows[None, :, None]
    if PADDED:
        mask = mask & (cols < valid)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit(do_not_specialize=["num_splits"])
def mla_decode_wsplit_kernel(
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    q_ptr,
    cache_ptr,
    block_table_ptr,
    token_req_ptr,
    token_kv_len_ptr,
    num_heads,
    num_splits,
    scale_log2,
    split_len,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_bt,
    LATENT: tl.constexpr,
    LATENT_PAD: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr,
    DOT_FP32: tl.constexpr,
    USE_PDL: tl.constexpr,
    CH: tl.constexpr = 4,
):
    """Grid ``(tokens, cdiv(H, BLOCK_H), num_splits)``, launched with ``CH`` warps; the same
    arguments, partials and output as ``mla_decode_kernel`` (see the module docstring)."""
    CW: tl.constexpr = LATENT_PAD // CH
    RW: tl.constexpr = ROPE_PAD // CH
    LP: tl.constexpr = LATENT_PAD != LATENT
    RP: tl.constexpr = ROPE_PAD != ROPE
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    tok = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    req = tl.load(token_req_ptr + tok)
    kv_len = tl.load(token_kv_len_ptr + tok)
    start = split * split_len
    end = tl.minimum(start + split_len, kv_len)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    q_row = (tok.to(tl.int64) * stride_qt + heads * stride_qh).to(tl.int64)
    # [CH, BLOCK_H, CW] latent and [CH, BLOCK_H, RW] rope query slices (warp w: chunk w).
    q_lat = _chunk_cols(q_ptr, q_row, head_mask, LATENT, CH, CW, LP)
    q_pe = _chunk_cols(q_ptr + LATENT, q_row, head_mask, ROPE, CH, RW, RP)
    if DOT_FP32:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_2d = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
    acc = tl.zeros([CH, BLOCK_H, CW], dtype=tl.float32)
    table_row = block_table_ptr + req.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        row, n_mask = _rows_of_tile(table_row, n0, end, stride_cb, stride_cs, BLOCK_SIZE,
                                    BLOCK_N)
        c = _chunk_cols(cache_ptr, row, n_mask, LATENT, CH, CW, LP)  # [CH, BLOCK_N, CW]
        k_pe = _chunk_cols(cache_ptr + LATENT, row, n_mask, ROPE, CH, RW, RP)
        if DOT_FP32:
            s_w = tl.dot(q_pe, tl.permute(k_pe.to(tl.float32), (0, 2, 1)),
                         input_precision="ieee")
            s_w = tl.dot(q_lat, tl.permute(c.to(tl.float32), (0, 2, 1)), s_w,
                         input_precision="ieee")
        else:
            s_w = tl.dot(q_pe, tl.permute(k_pe, (0, 2, 1)))
            s_w = tl.dot(q_lat, tl.permute(c, (0, 2, 1)), s_w)
        s = tl.sum(s_w, axis=0) * scale_log2  # [BLOCK_H, BLOCK_N], in every warp
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_2d = l_2d * alpha[:, None] + p
        acc = acc * alpha[None, :, None]
        if DOT_FP32:
            p3 = tl.broadcast_to(p[None, :, :], (CH, BLOCK_H, BLOCK_N))
            acc = tl.dot(p3, c.to(tl.float32), acc, input_precision="ieee")
        else:
            p3 = tl.broadcast_to(p.to(c.dtype)[None, :, :], (CH, BLOCK_H, BLOCK_N))
            acc = tl.dot(p3, c, acc)
        m_i = m_new
    l_i = tl.sum(l_2d, axis=1)

    cols = tl.arange(0, CH)[:, None, None] * CW + tl.arange(0, CW)[None, None, :]
    if WRITE_PARTIAL:
        part = (tok.to(tl.int64) * num_heads + heads) * num_splits + split
        scale = 1.0 / tl.maximum(l_i, 1.0)
        tl.store(part_ml_ptr + part * 2, m_i, mask=head_mask)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=head_mask)
        ptrs = part_acc_ptr + (part * LATENT_PAD)[None, :, None] + cols
        valid = LATENT_PAD
    else:
        ptrs = out_ptr + (tok.to(tl.int64) * stride_ot + heads * stride_oh)[None, :, None] + cols
        scale = 1.0 / l_i
        valid = LATENT
    tl.store(ptrs, (acc * scale[None, :, None]).to(ptrs.dtype.element_ty),
             mask=head_mask[None, :, None] & (cols < valid))
