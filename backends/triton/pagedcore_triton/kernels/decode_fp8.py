# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Single-token decode over an fp8 KV cache, without the ``[M, tokens] @ [tokens, D]`` dot.

The general kernel (``attention.py``) feeds V to ``tl.dot`` as the B operand of ``P @ V``:
contiguous along the head dimension, reduced along the tokens. For 8-bit elements there is no
``ldmatrix.trans``, so Triton moves V from shared memory to registers byte by byte, and that,
not the bytes read from memory, limits an fp8 decode (``docs/benchmarks/fp8_h200.json``).
This kernel serves one query token per request and one program per (request, KV head,
segment) and avoids that transfer in one of two ways (``MODE``):

* ``MODE == 1`` (swapped operands): ``S^T = K @ Q^T`` and ``O^T += V^T @ P^T``. The K/V tiles
  (converted to float16 in registers) are the A operands, whose rows are the tokens (QK) or
  the head dimension (PV), so the tensor-core tile is ``TILE_N x 16`` / ``D x 16`` instead of
  ``16 x TILE_N`` with only ``QPK`` of the 16 rows used; the query heads sit in the narrow N
  dimension (``BLOCK_M >= 16``, padded).
* ``MODE == 2`` (no tensor cores): ``S = sum_d Q[:, None, :] * K[None]`` and
  ``O += sum_n P[:, :, None] * V[None]`` as float32 multiply-adds in registers with
  ``BLOCK_M`` the GQA group padded to a power of two (4 rows, not 16): decode does ``QPK``
  multiply-adds per cache byte, little next to what the load costs.

The scales are folded into the softmax scale (K) and the final output (V). With
``NUM_SEGMENTS > 1`` segments write partial ``(acc, max, sum)`` rows in the general kernel's
layout, which `merge_segments_kernel` combines. ``USE_SINKS``: the first segment starts each
row's softmax with its sink logit. ``F32`` (Triton's interpreter, float32 queries) runs both
modes' arithmetic in float32.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["fp8_decode_kernel"]


@triton.jit
def _fp8_f16(x):
    """An fp8 tile as float16 (exact for every finite e4m3 / e5m2 value)."""
    return x.to(tl.float16)


@triton.jit
def _phys(t, limit, bt_row, kv_head_off, stride_cb, stride_cs, BLOCK_SIZE: tl.constexpr,
          TILE_N: tl.constexpr, MASKED: tl.constexpr, OFF32: tl.constexpr):
    """Tile `t`'s slot offsets (block table -> physical block) and which of its tokens are
    below `limit`."""
    n = t * TILE_N + tl.arange(0, TILE_N)
    offs_ty = tl.int32 if OFF32 else tl.int64
    if MASKED:
        n_ok = n < limit
        phys = tl.load(bt_row + n // BLOCK_SIZE, mask=n_ok, other=0).to(offs_ty)
    else:
        n_ok = n >= 0
        phys = tl.load(bt_row + n // BLOCK_SIZE).to(offs_ty)
    return phys * stride_cb + (n % BLOCK_SIZE).to(offs_ty) * stride_cs + kv_head_off, n_ok


@triton.jit
def _load_at(slot_off, n_ok, k_cache_ptr, v_cache_ptr, d, d_ok, PAD: tl.constexpr,
             MASKED: tl.constexpr):
    """K and V at `slot_off`, ``[TILE_N, HEAD_PAD]`` each (the head dimension contiguous);
    masked lanes load 0, never the cache's content."""
    ptrs = slot_off[:, None] + d[None, :]
    if MASKED:
        mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + ptrs, mask=mask, other=0.0)
        v = tl.load(v_cache_ptr + ptrs, mask=mask, other=0.0)
    elif PAD:
        k = tl.load(k_cache_ptr + ptrs, mask=d_ok[None, :], other=0.0)
        v = tl.load(v_cache_ptr + ptrs, mask=d_ok[None, :], other=0.0)
    else:
        k = tl.load(k_cache_ptr + ptrs)
        v = tl.load(v_cache_ptr + ptrs)
    return k, v


@triton.jit
def _load_kv(t, limit, bt_row, k_cache_ptr, v_cache_ptr, kv_head_off, stride_cb, stride_cs, d,
             d_ok, PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
             MASKED: tl.constexpr, OFF32: tl.constexpr):
    """Tile `t`'s K and V and which of its tokens are below `limit`."""
    slot_off, n_ok = _phys(t, limit, bt_row, kv_head_off, stride_cb, stride_cs, BLOCK_SIZE,
                           TILE_N, MASKED, OFF32)
    k, v = _load_at(slot_off, n_ok, k_cache_ptr, v_cache_ptr, d, d_ok, PAD, MASKED)
    return k, v, n_ok


@triton.jit
def _tile(q, m_i, l_i, acc, t, bt_row, k_cache_ptr, v_cache_ptr, kv_head_off, stride_cb,
          stride_cs, d, d_ok, seq_len, qk_scale,
          HEAD_PAD: tl.constexpr, PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
          TILE_N: tl.constexpr, MODE: tl.constexpr, MASKED: tl.constexpr,
          F32: tl.constexpr, OFF32: tl.constexpr):
    """One ``TILE_N``-token tile of the online softmax (base 2), loaded here."""
    k, v, n_ok = _load_kv(t, seq_len, bt_row, k_cache_ptr, v_cache_ptr, kv_head_off, stride_cb,
                          stride_cs, d, d_ok, PAD, BLOCK_SIZE, TILE_N, MASKED, OFF32)
    return _attend(q, m_i, l_i, acc, k, v, n_ok, qk_scale, MODE, MASKED, F32)


@triton.jit
def _attend(q, m_i, l_i, acc, k, v, n_ok, qk_scale, MODE: tl.constexpr, MASKED: tl.constexpr,
            F32: tl.constexpr):
    """The online softmax over one loaded K/V tile. MODE 1 / 3 keep `acc` as
    ``[HEAD_PAD, BLOCK_M]`` (transposed), MODE 2 as ``[BLOCK_M, HEAD_PAD]``."""
    if MODE == 1:
        # scores transposed: [TILE_N, BLOCK_M] = K [TILE_N, D] @ Q^T [D, BLOCK_M]
        if F32:
            s = tl.dot(k.to(tl.float32), q, input_precision="ieee")
        else:
            s = tl.dot(_fp8_f16(k), q)
        if MASKED:
            s = tl.where(n_ok[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0) * qk_scale)
        if MASKED:
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_safe = m_new
        p = tl.exp2(s * qk_scale - m_safe[None, :])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha[None, :]
        # O^T [D, BLOCK_M] += V^T [D, TILE_N] @ P^T [TILE_N, BLOCK_M]
        if F32:
            acc = tl.dot(tl.trans(v.to(tl.float32)), p, acc, input_precision="ieee")
        else:
            acc = tl.dot(tl.trans(_fp8_f16(v)), p.to(tl.float16), acc)
    elif MODE == 3:
        # scores [BLOCK_M, TILE_N] = Q @ K^T (K is the B operand along its contiguous head
        # dimension, which 8-bit tiles serve), O^T [D, BLOCK_M] += V^T @ P^T as in MODE 1
        if F32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(_fp8_f16(k)))
        if MASKED:
            s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        if MASKED:
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_safe = m_new
        p = tl.exp2(s * qk_scale - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[None, :]
        if F32:
            acc = tl.dot(tl.trans(v.to(tl.float32)), tl.trans(p), acc, input_precision="ieee")
        else:
            acc = tl.dot(tl.trans(_fp8_f16(v)), tl.trans(p.to(tl.float16)), acc)
    else:
        kf = k.to(tl.float32)
        s = tl.sum(q[:, None, :] * kf[None, :, :], 2)  # [BLOCK_M, TILE_N]
        if MASKED:
            s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        if MASKED:
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_safe = m_new
        p = tl.exp2(s * qk_scale - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        vf = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vf[None, :, :], 1)
    return m_new, l_i, acc


@triton.jit
def fp8_decode_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_offset,
    block_table_ptr,
    seq_lens_ptr,
    qsl_ptr,
    part_acc_ptr,
    part_ml_ptr,
    k_scale_ptr,
    v_scale_ptr,
    sinks_ptr,
    token_base,
    scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QPK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    MODE: tl.constexpr,
    USE_SINKS: tl.constexpr = False,
    F32: tl.constexpr = False,
    OFF32: tl.constexpr = False,
    KV_FP8: tl.constexpr = True,
    PREFETCH: tl.constexpr = 0,
):
    """Grid ``(num_reqs, Hkv, NUM_SEGMENTS)``; request ``r`` has exactly one query token, row
    ``qsl[r]`` of `q_ptr` / `out_ptr` (the caller routes only pure single-token decodes here).
    ``v_offset``: V's distance from K in the cache (elements). ``KV_FP8=False`` reads a
    16-bit cache with unit scales (for measuring the kernel against the bf16 decode)."""
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    q_begin = tl.load(qsl_ptr + req)
    if tl.load(qsl_ptr + req + 1) == q_begin:  # no query token this step
        return
    q_row = q_begin.to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + req)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < QPK
    head = kv_head * QPK + rows
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_SIZE

    n_tiles = tl.cdiv(seq_len, TILE_N)
    if NUM_SEGMENTS > 1:
        per_segment = tl.cdiv(n_tiles, NUM_SEGMENTS)
        t_start = segment * per_segment
        t_stop = tl.minimum(t_start + per_segment, n_tiles)
    else:
        t_start = 0
        t_stop = n_tiles
    full_stop = tl.maximum(t_start, tl.minimum(t_stop, seq_len // TILE_N))

    if KV_FP8:
        k_scale = tl.load(k_scale_ptr).to(tl.float32)
        v_scale = tl.load(v_scale_ptr).to(tl.float32)
    else:
        k_scale = 1.0
        v_scale = 1.0
    qk_scale = scale * k_scale * 1.4426950408889634  # log2(e): the softmax runs in base 2
    q = tl.load(q_ptr + q_row * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if USE_SINKS:
        if segment == 0:
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
            m_i = sink * 1.4426950408889634
            l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    if MODE == 1 or MODE == 3:
        if not F32:  # float16 operands; a query beyond +-65504 is outside what fp8 serves
            q = tl.clamp(q, -65504.0, 65504.0).to(tl.float16)
        if MODE == 1:
            q = tl.trans(q)  # [HEAD_PAD, BLOCK_M]
        acc = tl.zeros([HEAD_PAD, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    v_cache_ptr = k_cache_ptr + v_offset
    if OFF32:
        kv_head_off = kv_head * stride_ch
    else:
        kv_head_off = kv_head.to(tl.int64) * stride_ch

    if PREFETCH == 1:
        # K/V of tile t + 1 are loaded into registers while tile t is computed (the loop is
        # not software-pipelined: num_stages 1); loads past the segment are masked off.
        limit = tl.minimum(seq_len, t_stop * TILE_N)
        k_n, v_n, ok_n = _load_kv(t_start, limit, bt_row, k_cache_ptr, v_cache_ptr,
                                  kv_head_off, stride_cb, stride_cs, d, d_ok,
                                  HEAD_PAD != HEAD_SIZE, BLOCK_SIZE, TILE_N, True, OFF32)
        for t in range(t_start, t_stop):
            k = k_n
            v = v_n
            ok = ok_n
            k_n, v_n, ok_n = _load_kv(t + 1, limit, bt_row, k_cache_ptr, v_cache_ptr,
                                      kv_head_off, stride_cb, stride_cs, d, d_ok,
                                      HEAD_PAD != HEAD_SIZE, BLOCK_SIZE, TILE_N, True, OFF32)
            m_i, l_i, acc = _attend(q, m_i, l_i, acc, k, v, ok, qk_scale, MODE, True, F32)
    elif PREFETCH == 2:
        # as 1, and the block table two tiles ahead: tile t + 1's K/V loads need no wait for
        # their addresses
        limit = tl.minimum(seq_len, t_stop * TILE_N)
        off_n, ok_n = _phys(t_start, limit, bt_row, kv_head_off, stride_cb, stride_cs,
                            BLOCK_SIZE, TILE_N, True, OFF32)
        k_n, v_n = _load_at(off_n, ok_n, k_cache_ptr, v_cache_ptr, d, d_ok,
                            HEAD_PAD != HEAD_SIZE, True)
        off_nn, ok_nn = _phys(t_start + 1, limit, bt_row, kv_head_off, stride_cb, stride_cs,
                              BLOCK_SIZE, TILE_N, True, OFF32)
        for t in range(t_start, t_stop):
            k = k_n
            v = v_n
            ok = ok_n
            k_n, v_n = _load_at(off_nn, ok_nn, k_cache_ptr, v_cache_ptr, d, d_ok,
                                HEAD_PAD != HEAD_SIZE, True)
            ok_n = ok_nn
            off_nn, ok_nn = _phys(t + 2, limit, bt_row, kv_head_off, stride_cb, stride_cs,
                                  BLOCK_SIZE, TILE_N, True, OFF32)
            m_i, l_i, acc = _attend(q, m_i, l_i, acc, k, v, ok, qk_scale, MODE, True, F32)
    else:
        for t in range(t_start, full_stop):
            m_i, l_i, acc = _tile(
                q, m_i, l_i, acc, t, bt_row, k_cache_ptr, v_cache_ptr, kv_head_off, stride_cb,
                stride_cs, d, d_ok, seq_len, qk_scale, HEAD_PAD, HEAD_PAD != HEAD_SIZE,
                BLOCK_SIZE, TILE_N, MODE, False, F32, OFF32,
            )
        for t in range(full_stop, t_stop):
            m_i, l_i, acc = _tile(
                q, m_i, l_i, acc, t, bt_row, k_cache_ptr, v_cache_ptr, kv_head_off, stride_cb,
                stride_cs, d, d_ok, seq_len, qk_scale, HEAD_PAD, HEAD_PAD != HEAD_SIZE,
                BLOCK_SIZE, TILE_N, MODE, True, F32, OFF32,
            )

    if MODE == 1 or MODE == 3:
        acc = tl.trans(acc)  # [BLOCK_M, HEAD_PAD]
    acc = acc * v_scale
    if NUM_SEGMENTS == 1:
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + q_row * stride_ot + head[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        # partials: acc [Tp, Hq, S, HEAD_PAD], ml [Tp, Hq, S, 2] float32, contiguous.
        prow = ((q_row - token_base) * (QPK * tl.num_programs(1)) + head) * NUM_SEGMENTS
        prow += segment
        tl.store(part_acc_ptr + prow[:, None] * HEAD_PAD + d[None, :], acc,
                 mask=row_ok[:, None])
        tl.store(part_ml_ptr + prow * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + prow * 2 + 1, l_i, mask=row_ok)
