# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""MLA decode with the cache positions as the MMA's M side (``MLAKernelConfig.rows_m``).

Same contract, grid and partial layout as `pagedcore_triton.mla_kernels.mla_decode_kernel`, but
the products are transposed: scores ``s^T = c @ q^T`` are ``[BLOCK_N, BLOCK_H]`` and the output
accumulates ``acc^T += c^T @ p^T`` as ``[latent, BLOCK_H]``. With ``BLOCK_N`` (and the latent
chunk) a multiple of 64 and 4 warps, both products have an M of 64 or more, which lets Triton
use Hopper's asynchronous warpgroup MMA (``wgmma``) with the cache tile read straight from
shared memory, instead of chains of ``mma.sync`` with 16 query rows. The softmax runs along
axis 0 (positions).

Measured on the H200 (Triton 3.6, docs/mla.md): Triton does emit ``wgmma`` here, but the kernel
is slower than the 16-row ``mma.sync`` one at every shape (51-60 % of copy bandwidth with
``block_n`` 64, where the tile (165 KB of shared memory with 4 stages) leaves one program per
SM; 51-66 % with ``block_n`` 32). Kept as a selectable variant (``m64s4c4p``) for other GPUs and
Triton versions.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedcore_triton.mla_kernels import _load_cols, _rows_of_tile, _store_cols

__all__ = ["mla_decode_rows_kernel"]


@triton.jit
def _scores_t(c, q, scale_log2, DOT_FP32: tl.constexpr):
    """``scale_log2 * c @ q^T``: ``[BLOCK_N, BLOCK_H]`` in fp32 (c: rows, q: heads x cols)."""
    if DOT_FP32:
        s = tl.dot(c.to(tl.float32), tl.trans(q), input_precision="ieee")
    else:
        s = tl.dot(c, tl.trans(q))
    return s * scale_log2


@triton.jit
def _accumulate_t(p, c, acc, alpha, DOT_FP32: tl.constexpr):
    """``acc * alpha + c^T @ p`` with acc ``[cols, BLOCK_H]`` and p ``[BLOCK_N, BLOCK_H]``."""
    acc = acc * alpha[None, :]
    if DOT_FP32:
        acc = tl.dot(tl.trans(c.to(tl.float32)), p, acc, input_precision="ieee")
    else:
        acc = tl.dot(tl.trans(c), p.to(c.dtype), acc)
    return acc


@triton.jit(do_not_specialize=["num_splits"])
def mla_decode_rows_kernel(
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
    LAT_SPLIT: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr,
    DOT_FP32: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Grid ``(tokens, cdiv(H, BLOCK_H), num_splits)``; see the module docstring."""
    CW: tl.constexpr = LATENT_PAD // LAT_SPLIT
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
    # Queries [BLOCK_H, cols] (heads as rows; the dots transpose them).
    q_pe = _load_cols(q_ptr + LATENT, q_row, head_mask, 0, ROPE, ROPE_PAD, RP)
    q0 = _load_cols(q_ptr, q_row, head_mask, 0, LATENT, CW, LP)
    if LAT_SPLIT >= 2:
        q1 = _load_cols(q_ptr, q_row, head_mask, CW, LATENT, CW, LP)
    if LAT_SPLIT == 4:
        q2 = _load_cols(q_ptr, q_row, head_mask, 2 * CW, LATENT, CW, LP)
        q3 = _load_cols(q_ptr, q_row, head_mask, 3 * CW, LATENT, CW, LP)
    if DOT_FP32:
        q_pe = q_pe.to(tl.float32)
        q0 = q0.to(tl.float32)
        if LAT_SPLIT >= 2:
            q1 = q1.to(tl.float32)
        if LAT_SPLIT == 4:
            q2 = q2.to(tl.float32)
            q3 = q3.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc0 = tl.zeros([CW, BLOCK_H], dtype=tl.float32)
    if LAT_SPLIT >= 2:
        acc1 = tl.zeros([CW, BLOCK_H], dtype=tl.float32)
    if LAT_SPLIT == 4:
        acc2 = tl.zeros([CW, BLOCK_H], dtype=tl.float32)
        acc3 = tl.zeros([CW, BLOCK_H], dtype=tl.float32)
    table_row = block_table_ptr + req.to(tl.int64) * stride_bt

    for n0 in range(start, end, BLOCK_N):
        row, n_mask = _rows_of_tile(table_row, n0, end, stride_cb, stride_cs, BLOCK_SIZE,
                                    BLOCK_N)
        k_pe = _load_cols(cache_ptr + LATENT, row, n_mask, 0, ROPE, ROPE_PAD, RP)
        c0 = _load_cols(cache_ptr, row, n_mask, 0, LATENT, CW, LP)
        s = _scores_t(k_pe, q_pe, scale_log2, DOT_FP32)
        s += _scores_t(c0, q0, scale_log2, DOT_FP32)
        if LAT_SPLIT >= 2:
            c1 = _load_cols(cache_ptr, row, n_mask, CW, LATENT, CW, LP)
            s += _scores_t(c1, q1, scale_log2, DOT_FP32)
        if LAT_SPLIT == 4:
            c2 = _load_cols(cache_ptr, row, n_mask, 2 * CW, LATENT, CW, LP)
            c3 = _load_cols(cache_ptr, row, n_mask, 3 * CW, LATENT, CW, LP)
            s += _scores_t(c2, q2, scale_log2, DOT_FP32)
            s += _scores_t(c3, q3, scale_log2, DOT_FP32)
        s = tl.where(n_mask[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        p = tl.exp2(s - m_new[None, :])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc0 = _accumulate_t(p, c0, acc0, alpha, DOT_FP32)
        if LAT_SPLIT >= 2:
            acc1 = _accumulate_t(p, c1, acc1, alpha, DOT_FP32)
        if LAT_SPLIT == 4:
            acc2 = _accumulate_t(p, c2, acc2, alpha, DOT_FP32)
            acc3 = _accumulate_t(p, c3, acc3, alpha, DOT_FP32)
        m_i = m_new

    if WRITE_PARTIAL:
        # Partials acc / sum laid out [T, H, num_splits, LATENT_PAD] and (max, sum) as
        # [T, H, num_splits, 2].
        part = (tok.to(tl.int64) * num_heads + heads) * num_splits + split
        ptrs = part_acc_ptr + part[:, None] * LATENT_PAD
        # Normalised (acc / sum; the merge weighs each split by its sum). A non-empty split
        # has a sum >= 1; an empty one has acc = 0.
        scale = 1.0 / tl.maximum(l_i, 1.0)
        tl.store(part_ml_ptr + part * 2, m_i, mask=head_mask)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=head_mask)
        valid = LATENT_PAD
    else:
        ptrs = out_ptr + (tok.to(tl.int64) * stride_ot + heads * stride_oh)[:, None]
        scale = 1.0 / l_i
        valid = LATENT
    _store_cols(ptrs, tl.trans(acc0) * scale[:, None], 0, head_mask, valid, CW)
    if LAT_SPLIT >= 2:
        _store_cols(ptrs, tl.trans(acc1) * scale[:, None], CW, head_mask, valid, CW)
    if LAT_SPLIT == 4:
        _store_cols(ptrs, tl.trans(acc2) * scale[:, None], 2 * CW, head_mask, valid, CW)
        _store_cols(ptrs, tl.trans(acc3) * scale[:, None], 3 * CW, head_mask, valid, CW)
