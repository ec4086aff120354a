# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Unified paged attention over a mixed batch, with an optional split of the context (split-KV).

One program handles ``BLOCK_Q`` query tokens of one request times the ``QPK`` query heads that
share one KV head (``BLOCK_M = BLOCK_Q * QPK`` rows, padded to a power of two), so every K/V tile
is loaded once for the whole GQA group. Programs walk the request's context in tiles of
``TILE_N`` tokens, gathering each token's physical slot through the block table, with an online
softmax in base 2. With ``NUM_SEGMENTS > 1`` the tile range is cut into segments computed by
separate programs that write partial ``(acc, max, sum)`` triples; `merge_segments_kernel`
(``merge.py``) combines them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedcore_triton.kernels.merge import _flat_layout, merge_segments_kernel

__all__ = ["merge_segments_kernel", "paged_attention_kernel"]


@triton.jit
def _find_request(qsl_ptr, num_reqs, q_block_id, BLOCK_Q: tl.constexpr):
    """Largest request index ``i`` whose first query block is at or before `q_block_id`.

    Request ``i`` owns q-blocks from ``qsl[i] // BLOCK_Q - qsl[0] // BLOCK_Q + i`` on: an upper
    bound on the blocks the requests before it need, so ranges never overlap.
    """
    base = tl.load(qsl_ptr) // BLOCK_Q
    lo: tl.int32 = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(qsl_ptr + mid) // BLOCK_Q - base + mid
        if first <= q_block_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _grid_q_block(qsl_ptr, num_reqs, BLOCK_Q: tl.constexpr, LONGEST_FIRST: tl.constexpr):
    """``(q_block_id, req, q_begin, q_len, first_block)`` of this program on the classic grid
    (axis 0 over q-blocks, last-first with `LONGEST_FIRST`): its request, the request's
    query tokens and the request's first q-block."""
    if LONGEST_FIRST:
        q_block_id = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        q_block_id = tl.program_id(0)
    req = _find_request(qsl_ptr, num_reqs, q_block_id, BLOCK_Q)
    q_begin = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_begin
    first_block = q_begin // BLOCK_Q - tl.load(qsl_ptr) // BLOCK_Q + req
    return q_block_id, req, q_begin, q_len, first_block


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, t, bt_row, k_cache_ptr, v_cache_ptr, kv_head_off, stride_cb, stride_cs,
    d, d_ok, row_ok, pos_q, kv_begin, kv_end, slope, scale, qk_scale, soft_cap, window,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr,
    MASKED: tl.constexpr,
    OFF32: tl.constexpr = False,
    KV_CVT: tl.constexpr = 0,
):
    """One K/V tile of the online softmax; MASKED=False only for tiles every row fully sees.

    ``OFF32`` computes the cache offsets in int32 (the caller guarantees that the whole cache
    has fewer than 2**31 elements). ``KV_CVT`` is how an fp8 tile becomes a dot operand
    (`_fp8_operand`; `q` is then float16).
    """
    n = t * TILE_N + tl.arange(0, TILE_N)
    if OFF32:
        offs_ty = tl.int32
    else:
        offs_ty = tl.int64
    if MASKED:
        n_ok = (n < kv_end) & (n >= kv_begin)
        phys = tl.load(bt_row + n // BLOCK_SIZE, mask=n_ok, other=0).to(offs_ty)
        slot_off = phys * stride_cb + (n % BLOCK_SIZE).to(offs_ty) * stride_cs + kv_head_off
    else:
        n_ok = n >= 0
        phys = tl.load(bt_row + n // BLOCK_SIZE).to(offs_ty)
        slot_off = phys * stride_cb + (n % BLOCK_SIZE).to(offs_ty) * stride_cs + kv_head_off
    # Masked lanes load 0, never the cache's content (which may be NaN).
    k = _load_dn(k_cache_ptr, slot_off, d, n_ok, d_ok, MASKED, HEAD_PAD != HEAD_SIZE)
    v_ptrs = v_cache_ptr + slot_off[:, None] + d[None, :]
    # An fp8 cache is dequantized here, in registers: upcast to the query's dtype or to
    # float16 (`_fp8_operand`, exact for e4m3 and e5m2); the scales are folded into the
    # softmax scale and the final output.
    if DOT_FP32:
        s = tl.dot(q, k.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, _fp8_operand(k, q.dtype, KV_CVT))
    # Without soft-cap and ALiBi, s stays unscaled and the scale (with log2 e) is folded into
    # the exponent: exp2(s * qk_scale - m) is one fused multiply-add per score.
    if USE_SOFTCAP:
        s = s * scale
        s = soft_cap * (2.0 * tl.sigmoid(2.0 * s / soft_cap) - 1.0)
        s = s * 1.4426950408889634
    elif USE_ALIBI:
        s = s * qk_scale
    if USE_ALIBI:
        rel = (n[None, :] - pos_q[:, None]).to(tl.float32)
        s += slope[:, None] * rel * 1.4426950408889634
    if MASKED:
        visible = n_ok[None, :] & row_ok[:, None]
        if CAUSAL:
            visible = visible & (n[None, :] <= pos_q[:, None])
        if USE_WINDOW:
            visible = visible & (pos_q[:, None] - n[None, :] < window)
        s = tl.where(visible, s, float("-inf"))
    if USE_SOFTCAP or USE_ALIBI:
        m_new = tl.maximum(m_i, tl.max(s, 1))
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # qk_scale > 0: max commutes
    if MASKED:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_safe = m_new
    if USE_SOFTCAP or USE_ALIBI:
        p = tl.exp2(s - m_safe[:, None])
    else:
        p = tl.exp2(s * qk_scale - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    elif HEAD_PAD != HEAD_SIZE:
        v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
    else:
        v = tl.load(v_ptrs)
    acc = acc * alpha[:, None]
    if DOT_FP32:
        acc = tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
    else:
        if KV_CVT == 0:
            p = p.to(q.dtype)
        else:  # fp8 V tiles become float16 operands (`_fp8_operand`)
            p = p.to(tl.float16)
        acc = tl.dot(p, _fp8_operand(v, q.dtype, KV_CVT), acc)
    return m_new, l_i, acc


@triton.jit
def _load_dn(cache_ptr, slot_off, d, n_ok, d_ok, MASKED: tl.constexpr, PAD: tl.constexpr):
    """One ``[HEAD_PAD, TILE_N]`` tile of K at the tokens' slot offsets: masked lanes
    (tokens outside ``n_ok``, padding dims) load 0, never the cache's content."""
    ptrs = cache_ptr + slot_off[None, :] + d[:, None]
    if MASKED:
        x = tl.load(ptrs, mask=n_ok[None, :] & d_ok[:, None], other=0.0)
    elif PAD:
        x = tl.load(ptrs, mask=d_ok[:, None], other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _fp8_operand(x, dtype, KV_CVT: tl.constexpr):
    """A K/V tile as a dot operand: ``KV_CVT`` 0 casts to `dtype` (the query's), 1 casts an
    fp8 tile to float16 (Triton's cast), 2 rebuilds float16 from the fp8 bits with integer
    operations: e5m2 is float16's upper byte; an e4m3 byte ``s eeee mmm`` placed as
    ``s 0eeee mmm0000000`` is its value times 2**-8, exact for normals and subnormals (the
    caller multiplies the scales by 256, `_kv_scales`); 3 converts four bytes at a time with
    the sm_89+ instruction ``cvt.rn.f16x2.e4m3x2`` / ``.e5m2x2`` (inline PTX, GPU only).
    All are exact for every finite fp8 value."""
    if KV_CVT == 3:
        b = x.to(tl.uint8, bitcast=True)
        if x.dtype == tl.float8e5:
            h = tl.inline_asm_elementwise(
                "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e5m2x2 $0, lo; "
                "cvt.rn.f16x2.e5m2x2 $1, hi; }",
                "=r,=r,r", [b], dtype=tl.float16, is_pure=True, pack=4)
        else:
            h = tl.inline_asm_elementwise(
                "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; "
                "cvt.rn.f16x2.e4m3x2 $1, hi; }",
                "=r,=r,r", [b], dtype=tl.float16, is_pure=True, pack=4)
        return h
    elif KV_CVT == 2:
        b = x.to(tl.uint8, bitcast=True).to(tl.uint16)
        if x.dtype == tl.float8e5:
            h = b << 8
        else:
            h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
        return h.to(tl.float16, bitcast=True)
    elif KV_CVT == 1:
        return x.to(tl.float16)
    else:
        return x.to(dtype)


@triton.jit
def _initial_state(sinks_ptr, head, row_ok, with_sink, USE_SINKS: tl.constexpr,
                   BLOCK_M: tl.constexpr):
    """``(m, l)`` before the first tile: empty, or (in the one program per row that starts at
    the sink, `with_sink`) the sink as a first score, ``m = sink * log2 e`` and ``l = 1``:
    it joins the denominator and, with no value, adds nothing to the accumulator."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if USE_SINKS:
        if with_sink:
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
            m_i = sink * 1.4426950408889634
            l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    return m_i, l_i


@triton.jit
def _kv_scales(k_scale_ptr, v_scale_ptr, KV_FP8: tl.constexpr, KV_CVT: tl.constexpr = 0,
               E4M3: tl.constexpr = True):
    """This layer's fp8 dequantization scales (1.0 for a model-dtype cache), times 256 for
    e4m3 operands rebuilt from their bits (``KV_CVT == 2``, `_fp8_operand`)."""
    if KV_FP8:
        k_scale = tl.load(k_scale_ptr).to(tl.float32)
        v_scale = tl.load(v_scale_ptr).to(tl.float32)
        if KV_CVT == 2:
            if E4M3:
                k_scale = k_scale * 256.0
                v_scale = v_scale * 256.0
    else:
        k_scale = 1.0
        v_scale = 1.0
    return k_scale, v_scale


@triton.jit
def paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_offset,
    block_table_ptr,
    seq_lens_ptr,
    qsl_ptr,
    alibi_ptr,
    part_acc_ptr,
    part_ml_ptr,
    k_scale_ptr,
    v_scale_ptr,
    sinks_ptr,
    num_reqs,
    token_base,
    scale,
    soft_cap,
    window,
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
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SKIP_INTERIOR_MASKS: tl.constexpr,
    LONGEST_FIRST: tl.constexpr,
    EDGE_STAGES: tl.constexpr = None,
    OFF32: tl.constexpr = False,
    FLAT: tl.constexpr = False,
    MIN_SEGMENT_TILES: tl.constexpr = 1,
    REQ_PAD: tl.constexpr = 1,
    KV_FP8: tl.constexpr = False,
    USE_SINKS: tl.constexpr = False,
    KV_CVT: tl.constexpr = 0,
    PREFIX_SEGMENTS: tl.constexpr = 0,
):
    """Grid ``(q_blocks, Hkv, NUM_SEGMENTS)``, or ``(P, Hkv, 1)`` with ``FLAT``.

    ``v_offset`` is V's distance from K in the cache (elements): K is ``cache[0]``, V
    ``cache[1]``. With ``LONGEST_FIRST`` the q-blocks run last-first: under a causal mask the
    last q-blocks of a request see the most keys, and starting them first evens out the
    tail of the grid. ``EDGE_STAGES`` pipelines the masked loops with that many stages (None:
    ``num_stages``); ``OFF32`` computes K/V offsets in int32 (only for caches of fewer than
    2**31 elements: half the address arithmetic of the gather).

    ``FLAT`` (captured mixed steps): program ``p`` serves q-block ``p // S`` (compact
    numbering, see `_flat_layout`) and segment ``p % S``, with the step's q-block count and
    ``S <= NUM_SEGMENTS`` read from ``query_start_loc`` in one vector load of ``REQ_PAD >
    num_reqs`` lanes (`_flat_layout`, which also finds the request); programs past the
    used q-blocks exit after that read. Segments hold at least ``MIN_SEGMENT_TILES`` tiles; an
    empty one only marks its partial rows empty (max -inf) for the merge, and with ``S == 1``
    the output is written directly.

    ``KV_FP8``: the cache holds fp8, read as ``fp8 * scale`` with the ``[1]`` float32 scales
    at `k_scale_ptr` / `v_scale_ptr`. ``USE_SINKS``: `sinks_ptr` holds ``[Hq]`` float32 sink
    logits, which the first segment of each row starts its softmax with. ``KV_CVT`` (fp8
    only): how K/V tiles become dot operands, see `_fp8_operand`; with 1 or 2 the query and
    the probabilities enter the dots as float16.

    ``PREFIX_SEGMENTS > 0`` (cascade attention's suffix launch, classic grid, one segment):
    `part_acc_ptr` / `part_ml_ptr` hold the shared prefix's ``[T, Hq, PREFIX_SEGMENTS]``
    partials (`cascade_prefix_kernel`), merged into each row's state before it is written.
    """
    kv_head = tl.program_id(1)
    if FLAT:
        idx, starts, firsts, _, used, n_seg = _flat_layout(
            qsl_ptr, num_reqs, tl.num_programs(0), BLOCK_Q, NUM_SEGMENTS, REQ_PAD
        )
        slot = tl.program_id(0) // n_seg
        segment = tl.program_id(0) % n_seg
        if slot >= used:
            return
        if LONGEST_FIRST:
            q_block_id = used - 1 - slot
        else:
            q_block_id = slot
        # The last request starting at or before this q-block (firsts is non-decreasing).
        req = tl.sum(((idx < num_reqs) & (firsts <= q_block_id)).to(tl.int32), 0) - 1
        q_begin = tl.sum(tl.where(idx == req, starts, 0), 0)
        q_len = tl.sum(tl.where(idx == req + 1, starts, 0), 0) - q_begin
        first_block = tl.sum(tl.where(idx == req, firsts, 0), 0)
    else:
        n_seg = NUM_SEGMENTS
        segment = tl.program_id(2)
        q_block_id, req, q_begin, q_len, first_block = _grid_q_block(
            qsl_ptr, num_reqs, BLOCK_Q, LONGEST_FIRST
        )
    q_off = (q_block_id - first_block) * BLOCK_Q
    if q_off >= q_len:  # spare program of the over-provisioned grid
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = q_off + rows // QPK
    head = kv_head * QPK + rows % QPK
    row_ok = (rows < BLOCK_Q * QPK) & (tok < q_len)
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_SIZE
    q_rows = (q_begin + tok).to(tl.int64)
    if not FLAT:  # the classic grid keeps the load order its timings were measured with
        q = _load_q(q_ptr, q_rows, head, d, row_ok, d_ok, stride_qt, stride_qh, DOT_FP32,
                    KV_CVT != 0)
    pos_q = ctx_len + tok

    # Keys this q-block can see: [kv_begin, kv_end).
    if CAUSAL:
        kv_end = tl.minimum(seq_len, ctx_len + tl.minimum(q_off + BLOCK_Q, q_len))
    else:
        kv_end = seq_len
    kv_begin = 0
    if USE_WINDOW:
        kv_begin = tl.maximum(0, ctx_len + q_off - window + 1)
    tile_lo = kv_begin // TILE_N
    tile_hi = tl.cdiv(kv_end, TILE_N)
    if NUM_SEGMENTS > 1:
        per_segment = tl.cdiv(tile_hi - tile_lo, n_seg)
        if FLAT:
            per_segment = tl.maximum(per_segment, MIN_SEGMENT_TILES)
        t_start = tile_lo + segment * per_segment
        t_stop = tl.minimum(t_start + per_segment, tile_hi)
    else:
        t_start = tile_lo
        t_stop = tile_hi
    if FLAT:
        # partials: acc [Tp, Hq, S, HEAD_PAD], ml [Tp, Hq, S, 2] float32, contiguous.
        prow = ((q_rows - token_base) * (QPK * tl.num_programs(1)) + head) * NUM_SEGMENTS
        prow += segment
        if NUM_SEGMENTS > 1:
            if (n_seg > 1) & (t_start >= t_stop):  # empty segment: tell the merge, load nothing
                tl.store(part_ml_ptr + prow * 2, tl.full([BLOCK_M], float("-inf"), tl.float32),
                         mask=row_ok)
                return
        q = _load_q(q_ptr, q_rows, head, d, row_ok, d_ok, stride_qt, stride_qh, DOT_FP32,
                    KV_CVT != 0)

    if USE_ALIBI:
        slope = tl.load(alibi_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
    else:
        slope = tl.zeros([BLOCK_M], tl.float32)
    k_scale, v_scale = _kv_scales(k_scale_ptr, v_scale_ptr, KV_FP8, KV_CVT,
                                  k_cache_ptr.dtype.element_ty != tl.float8e5)
    scale = scale * k_scale
    qk_scale = scale * 1.4426950408889634  # fold log2(e): the softmax runs in base 2
    m_i, l_i = _initial_state(sinks_ptr, head, row_ok, segment == 0, USE_SINKS, BLOCK_M)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    v_cache_ptr = k_cache_ptr + v_offset
    if OFF32:
        kv_head_off = kv_head * stride_ch
    else:
        kv_head_off = kv_head.to(tl.int64) * stride_ch

    # With SKIP_INTERIOR_MASKS, tiles every row fully sees run without masks or -inf; only
    # the causal diagonal, the sequence's tail and the window's edge are masked. Measured on
    # the H200: +18% for prefill tiles, but slower for 16-row decode tiles, which keep the
    # single masked loop.
    if CAUSAL:
        full_hi = (ctx_len + q_off + 1) // TILE_N
    else:
        full_hi = seq_len // TILE_N
    if USE_WINDOW:
        last_q = ctx_len + tl.minimum(q_off + BLOCK_Q, q_len) - 1
        full_lo = tl.cdiv(tl.maximum(last_q - window + 1, 0), TILE_N)
    else:
        full_lo = tile_lo
    if SKIP_INTERIOR_MASKS:
        a = tl.minimum(t_stop, tl.maximum(t_start, full_lo))
        b = tl.minimum(t_stop, tl.maximum(a, full_hi))
        for t in tl.range(t_start, a, num_stages=EDGE_STAGES):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, t, bt_row, k_cache_ptr, v_cache_ptr, kv_head_off, stride_cb,
                stride_cs, d, d_ok, row_ok, pos_q, kv_begin, kv_end, slope, scale, qk_scale,
                soft_cap, window, HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, TILE_N, CAUSAL, USE_ALIBI,
                USE_SOFTCAP, USE_WINDOW, DOT_FP32, True, OFF32, KV_CVT,
            )
        for t in range(a, b):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, t, bt_row, k_cache_ptr, v_cache_ptr, kv_head_off, stride_cb,
                stride_cs, d, d_ok, row_ok, pos_q, kv_begin, kv_end, slope, scale, qk_scale,
                soft_cap, window, HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, TILE_N, CAUSAL, USE_ALIBI,
                USE_SOFTCAP, USE_WINDOW, DOT_FP32, False, OFF32, KV_CVT,
            )
        for t in tl.range(b, t_stop, num_stages=EDGE_STAGES):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, t, bt_row, k_cache_ptr, v_cache_ptr, kv_head_off, stride_cb,
                stride_cs, d, d_ok, row_ok, pos_q, kv_begin, kv_end, slope, scale, qk_scale,
                soft_cap, window, HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, TILE_N, CAUSAL, USE_ALIBI,
                USE_SOFTCAP, USE_WINDOW, DOT_FP32, True, OFF32, KV_CVT,
            )
    else:
        for t in range(t_start, t_stop):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, t, bt_row, k_cache_ptr, v_cache_ptr, kv_head_off, stride_cb,
                stride_cs, d, d_ok, row_ok, pos_q, kv_begin, kv_end, slope, scale, qk_scale,
                soft_cap, window, HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, TILE_N, CAUSAL, USE_ALIBI,
                USE_SOFTCAP, USE_WINDOW, DOT_FP32, True, OFF32, KV_CVT,
            )

    if KV_FP8:
        acc = acc * v_scale
    if FLAT:
        if NUM_SEGMENTS == 1:
            _store_output(
                out_ptr, acc, l_i, q_rows, head, d, row_ok, d_ok, stride_ot, stride_oh
            )
        elif n_seg == 1:
            _store_output(
                out_ptr, acc, l_i, q_rows, head, d, row_ok, d_ok, stride_ot, stride_oh
            )
        else:
            _store_partials(part_acc_ptr, part_ml_ptr, acc, m_i, l_i, prow, d, row_ok,
                            HEAD_PAD)
    elif NUM_SEGMENTS == 1:
        if PREFIX_SEGMENTS > 0:
            prow = (q_rows - token_base) * (QPK * tl.num_programs(1)) + head
            prow *= PREFIX_SEGMENTS
            m_i, l_i, acc = _fold_partials(part_acc_ptr, part_ml_ptr, m_i, l_i, acc, prow, d,
                                           row_ok, HEAD_PAD, PREFIX_SEGMENTS)
        # The classic grid's stores stay inline, as they were when its timings were taken.
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        # partials: acc [Tp, Hq, S, HEAD_PAD], ml [Tp, Hq, S, 2] float32, contiguous.
        prow = ((q_rows - token_base) * (QPK * tl.num_programs(1)) + head) * NUM_SEGMENTS
        prow += segment
        tl.store(
            part_acc_ptr + prow[:, None] * HEAD_PAD + d[None, :],
            acc,
            mask=row_ok[:, None],
        )
        tl.store(part_ml_ptr + prow * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + prow * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _fold_partials(part_acc_ptr, part_ml_ptr, m_i, l_i, acc, prow, d, row_ok,
                   HEAD_PAD: tl.constexpr, S: tl.constexpr):
    """Fold ``S`` partial states ``(acc, max, sum)`` at rows ``prow + s`` (base 2) into a
    row's running state; a partial that saw no key (max -inf) weighs nothing, and its other
    fields are never read."""
    for s in tl.static_range(S):
        m_s = tl.load(part_ml_ptr + (prow + s) * 2, mask=row_ok, other=float("-inf"))
        seen = m_s > float("-inf")
        l_s = tl.load(part_ml_ptr + (prow + s) * 2 + 1, mask=seen, other=0.0)
        a_s = tl.load(part_acc_ptr + (prow + s)[:, None] * HEAD_PAD + d[None, :],
                      mask=seen[:, None], other=0.0)
        m_new = tl.maximum(m_i, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        beta = tl.exp2(m_s - m_safe)
        acc = acc * alpha[:, None] + a_s * beta[:, None]
        l_i = l_i * alpha + l_s * beta
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _load_q(q_ptr, q_rows, head, d, row_ok, d_ok, stride_qt, stride_qh, DOT_FP32: tl.constexpr,
            Q_F16: tl.constexpr = False):
    """One program's query rows ``[BLOCK_M, HEAD_PAD]`` (fp32 when the dots run in fp32;
    float16 with `Q_F16`, clamped to its finite range: a bf16 query beyond +-65504 is
    outside what an fp8 cache's float16 dots serve)."""
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    elif Q_F16:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return q


@triton.jit
def _store_output(out_ptr, acc, l_i, q_rows, head, d, row_ok, d_ok, stride_ot, stride_oh):
    """Normalize and write one program's rows of the output."""
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


@triton.jit
def _store_partials(
    part_acc_ptr, part_ml_ptr, acc, m_i, l_i, prow, d, row_ok, HEAD_PAD: tl.constexpr
):
    """Write one segment's partial ``(acc, max, sum)`` rows for `merge_segments_kernel`."""
    tl.store(part_acc_ptr + prow[:, None] * HEAD_PAD + d[None, :], acc, mask=row_ok[:, None])
    tl.store(part_ml_ptr + prow * 2, m_i, mask=row_ok)
    tl.store(part_ml_ptr + prow * 2 + 1, l_i, mask=row_ok)
