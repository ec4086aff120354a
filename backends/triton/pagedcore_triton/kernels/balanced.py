# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Length-balanced split-KV decode: segments sized by the step's work, not by its batch size.

The uniform split-KV plan cuts every request of a decode launch into the same number of
segments ``S``, chosen from the batch size. One 32K-token request among twenty short ones then
gets ``S = 2`` segments (the grid already holds ``21 * Hkv`` programs) and two programs per KV
head stream 16K tokens each while the rest of the GPU idles. Here the grid is ``P`` programs
per KV head (``P = R + G`` from the shapes only, see `pagedcore_triton.plan.balanced_grid_size`)
and every program derives the same layout from ``seq_lens`` at run time (`_balanced_layout`,
one ``[REQ_PAD]`` vector load):

* ``tiles_r``: the ``TILE_N``-token K/V tiles request ``r`` must read (its sliding window only);
* ``L = max(cdiv(sum tiles_r, G), MIN_TILES)`` tiles per segment at most;
* ``s_r = max(1, cdiv(tiles_r, L))`` segments of request ``r`` (an empty request still gets
  one program, which writes its output row: zeros), its tiles dealt evenly over them.

``sum s_r <= sum (tiles_r / L + 1) <= G + R = P``, so the grid always suffices; programs past
the last segment exit after the layout. Request ``r``'s segments are the slots
``[end_r - s_r, end_r)`` (``end`` = inclusive prefix sum of ``s``); which program serves which
slot is the program order (``HEADS_FIRST``, ``ROUND_ROBIN``: see `balanced_decode_kernel`).

Partials are stored compactly per slot, ``[P, Hq, HEAD_PAD]`` (acc) and ``[P, Hq, 2]``
(max, sum) float32: the number of segments of one request is unbounded (up to ``G + 1``), so a
per-(token, segment) layout would need ``R * (G + 1)`` rows, most of them unused, where the
per-slot one needs exactly ``P``. A request with ``s_r == 1`` writes its output directly.
Its first segment's program (KV head 0) also records ``(request, first slot, s_r)`` of each
split request in a small table (``info``, ``[1 + 3 * G]`` int32, entry 0 = how many), so the
merge launch is ``(G, Hq)`` programs of which all but the split requests' exit after one load
(at most ``G - 1`` requests can split: each holds more than ``L >= sum tiles / G`` tiles).
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedcore_triton.kernels.attention import (
    _attend_tile,
    _initial_state,
    _kv_scales,
    _load_q,
    _store_output,
)

__all__ = ["balanced_decode_kernel", "balanced_merge_kernel"]


@triton.jit
def _balanced_layout(
    seq_lens_ptr,
    num_reqs,
    budget,
    window,
    TILE_N: tl.constexpr,
    MIN_TILES: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    REQ_PAD: tl.constexpr,
):
    """The step's segments, from one vector load of ``seq_lens`` (see the module docstring).

    Returns ``(idx, lens, tiles, segs, ends)``, ``[REQ_PAD]`` lanes (zero past `num_reqs`):
    sequence lengths, tiles to read, segments and their inclusive prefix sum.
    """
    idx = tl.arange(0, REQ_PAD)
    ok = idx < num_reqs
    lens = tl.load(seq_lens_ptr + idx, mask=ok, other=0)
    hi = tl.cdiv(lens, TILE_N)
    if USE_WINDOW:  # the decode query sits at lens - 1 and sees keys from lens - window on
        tiles = hi - tl.maximum(lens - window, 0) // TILE_N
    else:
        tiles = hi
    total = tl.sum(tiles, 0)
    per = tl.maximum(tl.cdiv(total, budget), MIN_TILES)
    segs = tl.where(ok, tl.maximum(tl.cdiv(tiles, per), 1), 0)
    ends = tl.cumsum(segs, 0)
    return idx, lens, tiles, segs, ends


@triton.jit
def balanced_decode_kernel(
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
    info_ptr,
    k_scale_ptr,
    v_scale_ptr,
    sinks_ptr,
    num_reqs,
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
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr,
    OFF32: tl.constexpr,
    MIN_TILES: tl.constexpr,
    REQ_PAD: tl.constexpr,
    HEADS_FIRST: tl.constexpr = False,
    ROUND_ROBIN: tl.constexpr = False,
    KV_FP8: tl.constexpr = False,
    USE_SINKS: tl.constexpr = False,
    KV_CVT: tl.constexpr = 0,
):
    """Grid ``(P, Hkv)``, or ``(Hkv, P)`` with ``HEADS_FIRST`` (the KV heads of one segment
    launched next to each other): program ``p`` serves one segment of one single-token
    request. In request-major order (the default) program ``p`` is segment ``p - first_r``
    of the request whose range holds ``p``; with ``ROUND_ROBIN`` the programs deal the first
    segment of every request, then the second of those with two or more, and so on (found by
    a binary search over rounds), so that the segments running together belong to different
    requests. Partials stay request-major (row ``first_r + segment``) either way.

    Every request has one query token (``qsl[r + 1] - qsl[r] == 1``; a request with none is
    skipped) that sees its whole context (the last position: causal or not is the same).
    """
    if HEADS_FIRST:
        kv_head = tl.program_id(0)
        p = tl.program_id(1)
        num_kv_heads = tl.num_programs(0)
        budget = tl.num_programs(1) - num_reqs
    else:
        p = tl.program_id(0)
        kv_head = tl.program_id(1)
        num_kv_heads = tl.num_programs(1)
        budget = tl.num_programs(0) - num_reqs
    idx, lens, tiles, segs, ends = _balanced_layout(
        seq_lens_ptr, num_reqs, budget, window, TILE_N, MIN_TILES, USE_WINDOW, REQ_PAD
    )
    if p >= tl.max(ends, 0):
        return
    if ROUND_ROBIN:
        # round k: the largest with sum(min(segs, k)) <= p; then the i-th request still alive
        lo: tl.int32 = 0
        hi = tl.max(segs, 0)
        while lo + 1 < hi:
            mid = (lo + hi) // 2
            fits = tl.sum(tl.minimum(segs, mid), 0) <= p
            lo = tl.where(fits, mid, lo)
            hi = tl.where(fits, hi, mid)
        alive = segs > lo
        alive_rank = tl.cumsum(alive.to(tl.int32), 0) - 1  # (a name of its own: a vector)
        i = p - tl.sum(tl.minimum(segs, lo), 0)
        req = tl.sum(tl.where(alive & (alive_rank == i), idx, 0), 0)
        segment = lo
    else:
        req = tl.sum((ends <= p).to(tl.int32), 0)
    mine = idx == req
    n_seg = tl.sum(tl.where(mine, segs, 0), 0)
    first = tl.sum(tl.where(mine, ends, 0), 0) - n_seg
    seq_len = tl.sum(tl.where(mine, lens, 0), 0)
    n_tiles = tl.sum(tl.where(mine, tiles, 0), 0)
    if not ROUND_ROBIN:
        segment = p - first
    if (segment == 0) & (kv_head == 0) & (n_seg > 1):
        split = (segs > 1).to(tl.int32)
        rank = tl.sum(tl.where(mine, tl.cumsum(split, 0) - 1, 0), 0)
        tl.store(info_ptr + 1 + 3 * rank, req)
        tl.store(info_ptr + 2 + 3 * rank, first)
        tl.store(info_ptr + 3 + 3 * rank, n_seg)
    if (first + segment == 0) & (kv_head == 0):
        tl.store(info_ptr, tl.sum((segs > 1).to(tl.int32), 0))
    q_begin = tl.load(qsl_ptr + req)
    if tl.load(qsl_ptr + req + 1) <= q_begin:  # no query token: nothing to compute
        return

    per = tl.cdiv(n_tiles, n_seg)
    tile_hi = tl.cdiv(seq_len, TILE_N)
    t_start = tile_hi - n_tiles + segment * per
    t_stop = tl.minimum(t_start + per, tile_hi)
    kv_end = seq_len
    kv_begin = 0
    if USE_WINDOW:
        kv_begin = tl.maximum(seq_len - window, 0)

    rows = tl.arange(0, BLOCK_M)
    head = kv_head * QPK + rows % QPK
    row_ok = rows < QPK
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_SIZE
    q_rows = (q_begin + rows * 0).to(tl.int64)
    q = _load_q(q_ptr, q_rows, head, d, row_ok, d_ok, stride_qt, stride_qh, DOT_FP32,
                KV_CVT != 0)
    pos_q = seq_len - 1 + rows * 0
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
    for t in range(t_start, t_stop):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, t, bt_row, k_cache_ptr, v_cache_ptr, kv_head_off, stride_cb,
            stride_cs, d, d_ok, row_ok, pos_q, kv_begin, kv_end, slope, scale, qk_scale,
            soft_cap, window, HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, TILE_N, False, USE_ALIBI,
            USE_SOFTCAP, USE_WINDOW, DOT_FP32, True, OFF32, KV_CVT,
        )
    if KV_FP8:
        acc = acc * v_scale
    if n_seg == 1:
        _store_output(out_ptr, acc, l_i, q_rows, head, d, row_ok, d_ok, stride_ot, stride_oh)
    else:
        # partials: acc [P, Hq, HEAD_PAD], ml [P, Hq, 2] float32, one row per (segment, head)
        prow = (first + segment).to(tl.int64) * (QPK * num_kv_heads) + head
        tl.store(part_acc_ptr + prow[:, None] * HEAD_PAD + d[None, :], acc,
                 mask=row_ok[:, None])
        tl.store(part_ml_ptr + prow * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + prow * 2 + 1, l_i, mask=row_ok)


@triton.jit
def balanced_merge_kernel(
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    info_ptr,
    qsl_ptr,
    stride_ot,
    stride_oh,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SEG_CHUNK: tl.constexpr,
):
    """Grid ``(G, Hq)``: program ``(i, h)`` merges head ``h`` of the ``i``-th split request
    (``info``, written by `balanced_decode_kernel`), ``SEG_CHUNK`` segments at a time."""
    i = tl.program_id(0)
    head = tl.program_id(1)
    if i >= tl.load(info_ptr):
        return
    req = tl.load(info_ptr + 1 + 3 * i)
    first = tl.load(info_ptr + 2 + 3 * i)
    n_seg = tl.load(info_ptr + 3 + 3 * i)
    q_begin = tl.load(qsl_ptr + req)
    if tl.load(qsl_ptr + req + 1) <= q_begin:
        return
    num_heads = tl.num_programs(1)
    s = tl.arange(0, SEG_CHUNK)
    d = tl.arange(0, HEAD_PAD)
    m_run = tl.max(tl.full([SEG_CHUNK], float("-inf"), tl.float32), 0)
    l_run = tl.sum(tl.zeros([SEG_CHUNK], tl.float32), 0)
    acc = tl.zeros([HEAD_PAD], tl.float32)
    for c in range(0, n_seg, SEG_CHUNK):
        seg_ok = c + s < n_seg
        prow = (first + c + s).to(tl.int64) * num_heads + head
        m = tl.load(part_ml_ptr + prow * 2, mask=seg_ok, other=float("-inf"))
        seen = m > float("-inf")
        lse = tl.load(part_ml_ptr + prow * 2 + 1, mask=seen, other=0.0)
        part = tl.load(part_acc_ptr + prow[:, None] * HEAD_PAD + d[None, :],
                       mask=seen[:, None], other=0.0)
        m_new = tl.maximum(m_run, tl.max(m, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - m_safe)
        w = tl.exp2(m - m_safe)  # segments that saw no key (m = -inf) weigh 0
        l_run = l_run * alpha + tl.sum(w * lse, 0)
        acc = acc * alpha + tl.sum(part * w[:, None], 0)
        m_run = m_new
    out = acc / tl.where(l_run > 0.0, l_run, 1.0)
    row = q_begin.to(tl.int64) * stride_ot + head * stride_oh
    tl.store(out_ptr + row + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_SIZE)
