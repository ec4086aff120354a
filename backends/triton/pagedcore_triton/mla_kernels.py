# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Triton kernels for multi-head latent attention (MLA) over a paged latent cache.

The cache is ``[num_blocks, block_size, L + R]``: one row per token holding the compressed
latent ``c`` (``L`` values, which are also the values) and the roped shared key ``k_pe``
(``R`` values). One program serves one query token and ``BLOCK_H`` query heads: every cache
row it loads is shared by all those heads (the point of MLA: one latent "head"), scores are
``dot(q_lat, c) + dot(q_pe, k_pe)``, the online softmax runs in base 2, and the output
accumulates ``p @ c`` in latent space (``[BLOCK_H, L]``).

Each token sees the first ``kv_len`` positions of its request (``kv_len`` = context + its index
in the step + 1: causal aligned to the end), so one kernel serves decodes and prefill tokens of a
mixed batch. With ``NUM_SPLITS > 1`` (split-KV, for long contexts with few tokens) the positions
are cut into ``split_len``-token segments computed by separate programs that write partial
``(acc, max, sum)``; `mla_merge_kernel` combines them.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["mla_decode_kernel", "mla_merge_kernel"]


@triton.jit
def mla_decode_kernel(
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    q_ptr,
    cache_ptr,
    block_table_ptr,
    token_req_ptr,
    token_kv_len_ptr,
    num_heads,
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
    NUM_SPLITS: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Grid ``(tokens, cdiv(H, BLOCK_H), NUM_SPLITS)``; see the module docstring."""
    tok = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)

    req = tl.load(token_req_ptr + tok)
    kv_len = tl.load(token_kv_len_ptr + tok)
    start = split * split_len
    end = tl.minimum(start + split_len, kv_len)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    offs_l = tl.arange(0, LATENT_PAD)
    offs_r = tl.arange(0, ROPE_PAD)
    l_mask = offs_l < LATENT
    r_mask = offs_r < ROPE

    # Masks along the feature dim only where it is padded: an all-true mask the compiler cannot
    # prove constant would stop it from vectorising the row loads.
    if LATENT_PAD == LATENT:
        l_mask_2d = tl.full([1, LATENT_PAD], 1, tl.int1)
    else:
        l_mask_2d = l_mask[None, :]
    if ROPE_PAD == ROPE:
        r_mask_2d = tl.full([1, ROPE_PAD], 1, tl.int1)
    else:
        r_mask_2d = r_mask[None, :]

    q_row = q_ptr + tok.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + offs_l[None, :], mask=head_mask[:, None] & l_mask_2d, other=0.0)
    q_pe = tl.load(q_row + LATENT + offs_r[None, :], mask=head_mask[:, None] & r_mask_2d,
                   other=0.0)
    if DOT_FP32:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, LATENT_PAD], dtype=tl.float32)
    table_row = block_table_ptr + req.to(tl.int64) * stride_bt

    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        block = tl.load(table_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
        row = block.to(tl.int64) * stride_cb + (offs_n % BLOCK_SIZE).to(tl.int64) * stride_cs
        c = tl.load(cache_ptr + row[:, None] + offs_l[None, :],
                    mask=n_mask[:, None] & l_mask_2d, other=0.0)
        k_pe = tl.load(cache_ptr + row[:, None] + LATENT + offs_r[None, :],
                       mask=n_mask[:, None] & r_mask_2d, other=0.0)
        if DOT_FP32:
            c = c.to(tl.float32)
            k_pe = k_pe.to(tl.float32)
            s = tl.dot(q_lat, tl.trans(c), input_precision="ieee")
            s += tl.dot(q_pe, tl.trans(k_pe), input_precision="ieee")
        else:
            s = tl.dot(q_lat, tl.trans(c))
            s += tl.dot(q_pe, tl.trans(k_pe))
        s = tl.where(n_mask[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, c, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        o_ptrs = out_ptr + tok.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
        tl.store(o_ptrs + offs_l[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=head_mask[:, None] & l_mask[None, :])
    else:
        # Partials laid out [T, H, NUM_SPLITS, LATENT_PAD] and [T, H, NUM_SPLITS, 2].
        part = (tok.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * LATENT_PAD + offs_l[None, :], acc,
                 mask=head_mask[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=head_mask)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=head_mask)


@triton.jit
def mla_merge_kernel(
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    num_heads,
    stride_ot,
    stride_oh,
    LATENT: tl.constexpr,
    LATENT_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """Grid ``(tokens, H)``: combine the split partials of one token and head (log-sum-exp)."""
    tok = tl.program_id(0)
    head = tl.program_id(1)
    base = (tok.to(tl.int64) * num_heads + head) * NUM_SPLITS
    splits = tl.arange(0, NUM_SPLITS)
    m = tl.load(part_ml_ptr + (base + splits) * 2)
    lsum = tl.load(part_ml_ptr + (base + splits) * 2 + 1)
    m_max = tl.max(m, axis=0)
    # Empty splits carry m = -inf and weigh exp2(-inf) = 0; split 0 is never empty.
    w = tl.exp2(m - m_max)
    offs_l = tl.arange(0, LATENT_PAD)
    acc = tl.load(part_acc_ptr + (base + splits)[:, None] * LATENT_PAD + offs_l[None, :])
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(lsum * w, axis=0)
    tl.store(out_ptr + tok.to(tl.int64) * stride_ot + head * stride_oh + offs_l,
             out.to(out_ptr.dtype.element_ty), mask=offs_l < LATENT)
