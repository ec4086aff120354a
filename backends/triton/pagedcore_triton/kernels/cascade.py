# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Cascade attention: the shared prefix attended once for every query, and the final merge.

`cascade_prefix_kernel` walks the step's shared prefix blocks (one block-table row: every
request holds the same physical blocks there) with *all* query rows of a KV head as the M
dimension (``T * QPK`` rows, in tiles of ``BLOCK_M``), so each prefix K/V tile is read once per
M tile instead of once per request. No causal mask: every query lies after the prefix. It
writes split-KV partials ``(acc, max, sum)`` in base 2, the layout `paged_attention_kernel`'s
segments use, and `cascade_merge_kernel` combines them with the suffix launch's partials.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedcore_triton.kernels.attention import _attend_tile, _load_q, _store_partials

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
):
    """Grid ``(cdiv(T * QPK, BLOCK_M), Hkv, NUM_SEGMENTS)``; partials ``[T, Hq, S, HEAD_PAD]``
    and ``[T, Hq, S, 2]`` float32 (row ``r`` of a KV head is token ``r // QPK``, query head
    ``kv_head * QPK + r % QPK``)."""
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // QPK
    head = kv_head * QPK + rows % QPK
    row_ok = tok < num_tokens
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_SIZE
    q_rows = tok.to(tl.int64)
    q = _load_q(q_ptr, q_rows, head, d, row_ok, d_ok, stride_qt, stride_qh, DOT_FP32)
    qk_scale = scale * 1.4426950408889634
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    slope = tl.zeros([BLOCK_M], tl.float32)
    pos_q = tl.zeros([BLOCK_M], tl.int32)  # unused: no causal mask, no ALiBi, no window
    tiles = tl.cdiv(prefix_len, TILE_N)
    per_segment = tl.cdiv(tiles, NUM_SEGMENTS)
    t_start = segment * per_segment
    t_stop = tl.minimum(t_start + per_segment, tiles)
    kv_head_off = kv_head.to(tl.int64) * stride_ch
    for t in range(t_start, t_stop):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, t, prefix_blocks_ptr, k_cache_ptr, k_cache_ptr + v_offset,
            kv_head_off, stride_cb, stride_cs, d, d_ok, row_ok, pos_q, 0, prefix_len, slope,
            scale, qk_scale, soft_cap, 0, HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, TILE_N, False,
            False, USE_SOFTCAP, False, DOT_FP32, True,
        )
    prow = (q_rows * (QPK * tl.num_programs(1)) + head) * NUM_SEGMENTS + segment
    _store_partials(part_acc_ptr, part_ml_ptr, acc, m_i, l_i, prow, d, row_ok, HEAD_PAD)


@triton.jit
def _load_partials(acc_ptr, ml_ptr, tok, head, num_heads, d, S: tl.constexpr,
                   HEAD_PAD: tl.constexpr):
    s = tl.arange(0, S)
    prow = (tok * num_heads + head) * S + s
    m = tl.load(ml_ptr + prow * 2)
    seen = m > float("-inf")
    l_i = tl.load(ml_ptr + prow * 2 + 1, mask=seen, other=0.0)
    acc = tl.load(acc_ptr + prow[:, None] * HEAD_PAD + d[None, :], mask=seen[:, None], other=0.0)
    return m, l_i, acc


@triton.jit
def cascade_merge_kernel(
    out_ptr,
    sfx_acc_ptr,
    sfx_ml_ptr,
    pfx_acc_ptr,
    pfx_ml_ptr,
    stride_ot,
    stride_oh,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SUFFIX_SEGMENTS: tl.constexpr,
    PREFIX_SEGMENTS: tl.constexpr,
):
    """Grid ``(T, Hq)``: the log-sum-exp merge of the suffix's and the prefix's partials."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    d = tl.arange(0, HEAD_PAD)
    m_a, l_a, acc_a = _load_partials(sfx_acc_ptr, sfx_ml_ptr, tok, head, num_heads, d,
                                     SUFFIX_SEGMENTS, HEAD_PAD)
    m_b, l_b, acc_b = _load_partials(pfx_acc_ptr, pfx_ml_ptr, tok, head, num_heads, d,
                                     PREFIX_SEGMENTS, HEAD_PAD)
    m_max = tl.maximum(tl.max(m_a, 0), tl.max(m_b, 0))
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w_a = tl.exp2(m_a - m_safe)
    w_b = tl.exp2(m_b - m_safe)
    total = tl.sum(w_a * l_a, 0) + tl.sum(w_b * l_b, 0)
    out = tl.sum(acc_a * w_a[:, None], 0) + tl.sum(acc_b * w_b[:, None], 0)
    out = out / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_SIZE)
