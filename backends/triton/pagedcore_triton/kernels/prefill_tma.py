# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Prefill attention for Hopper (sm_90): the step's own K/V through tensor descriptors (TMA).

A prefill chunk's own keys and values arrive contiguously in ``forward()``'s `key` / `value`
arguments (``[T, Hkv, D]``), so this kernel reads them as ``[TILE_N, D]`` boxes of a 2-D
``[T, Hkv * D]`` tensor descriptor (one bulk copy per tile, software-pipelined by Triton)
instead of gathering every row through the block table. Only a cached prefix (a chunk that
continues earlier tokens) is read from the paged cache, with the gather of
`paged_attention_kernel` (`_attend_tile`).

One program owns ``BLOCK_Q`` query tokens of one request times the ``QPK`` query heads of one
KV head (``BLOCK_M`` rows, token-major), so each K/V tile serves the whole GQA group. Causal:
tiles entirely below the diagonal run without any mask, the one or two tiles on it with the
mask; tiles above it are never visited. The softmax runs in base 2 with the scale and log2 e
folded into one multiply-add per score.

NaN-safety: the descriptors end at the launch's last real token (``token_end``), so padding
tokens' rows (which may hold anything) read as TMA's zero fill; key rows past the request
(the next request's, finite, or that fill) only reach masked tiles, where their scores
become ``-inf`` (probability 0).
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedcore_triton.kernels.attention import _attend_tile, _find_request, _grid_q_block

__all__ = [
    "prefill_tma_kernel",
    "prefill_tma_ws_kernel",
    "prefill_tma_ws_persistent_kernel",
]


@triton.jit
def _own_tile(
    q, m_i, l_i, acc, k_desc, v_desc, row0, col, j0, tok, q_len, qk_scale,
    TILE_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """One tile of the request's own keys ``[j0, j0 + TILE_N)`` (rows ``row0 + j0 ..`` of the
    descriptors). ``MASKED=False`` only for tiles that every row of the program fully sees."""
    k = k_desc.load([row0 + j0, col])
    if DOT_FP32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if MASKED:
        j = j0 + tl.arange(0, TILE_N)
        visible = j[None, :] < q_len
        if CAUSAL:
            visible = visible & (j[None, :] <= tok[:, None])
        s = tl.where(visible, s, float("-inf"))
    # Every row saw key 0 in the first tile it visited, so m_new is finite from then on.
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    v = v_desc.load([row0 + j0, col])
    if DOT_FP32:
        acc = tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return m_new, l_i, acc


@triton.jit
def prefill_tma_kernel(
    out_ptr,
    q_ptr,
    k_desc,
    v_desc,
    kd_desc,
    vd_desc,
    k_cache_ptr,
    v_offset,
    block_table_ptr,
    seq_lens_ptr,
    qsl_ptr,
    num_reqs,
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
    BLOCK_SIZE: tl.constexpr,
    QPK: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    DOT_FP32: tl.constexpr,
    LONGEST_FIRST: tl.constexpr,
    OFF32: tl.constexpr,
    INNER_STAGES: tl.constexpr,
    EDGE_STAGES: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    DIAG_N: tl.constexpr = 0,
    HEADS_FAST: tl.constexpr = False,
):
    """Grid ``(q_blocks, Hkv)``, or ``(Hkv, q_blocks)`` with ``HEADS_FAST`` (every KV head
    of a q-block before the next q-block): q-block numbering as in `paged_attention_kernel`.

    `k_desc` / `v_desc`: tensor descriptors over the step's own ``key`` / ``value`` viewed as
    ``[token_end, Hkv * HEAD_SIZE]`` with ``[TILE_N, HEAD_SIZE]`` blocks; row ``t`` is the
    query token ``t``'s key; `kd_desc` / `vd_desc` the same with ``[DIAG_N, HEAD_SIZE]``
    blocks (``DIAG_N > 0``, causal only: the keys between the last whole ``TILE_N`` tile
    below the q-block and its first token run in ``DIAG_N`` tiles without a mask, and only
    the ``DIAG_N`` tiles over the q-block's own tokens are masked). ``HAS_PREFIX``: some
    request has cached context (``seq_len > q_len``), read from the paged cache
    ``[2, N, BLOCK_SIZE, Hkv, HEAD_SIZE]`` (V at `v_offset` elements from K) through the
    block table.
    """
    if HEADS_FAST:
        kv_head = tl.program_id(0)
        if LONGEST_FIRST:
            q_block_id = tl.num_programs(1) - 1 - tl.program_id(1)
        else:
            q_block_id = tl.program_id(1)
        req = _find_request(qsl_ptr, num_reqs, q_block_id, BLOCK_Q)
        q_begin = tl.load(qsl_ptr + req)
        q_len = tl.load(qsl_ptr + req + 1) - q_begin
        first_block = q_begin // BLOCK_Q - tl.load(qsl_ptr) // BLOCK_Q + req
    else:
        kv_head = tl.program_id(1)
        q_block_id, req, q_begin, q_len, first_block = _grid_q_block(
            qsl_ptr, num_reqs, BLOCK_Q, LONGEST_FIRST
        )
    q_off = (q_block_id - first_block) * BLOCK_Q
    if q_off >= q_len:  # spare program of the over-provisioned grid
        return

    rows = tl.arange(0, BLOCK_M)
    tok = q_off + rows // QPK
    head = kv_head * QPK + rows % QPK
    row_ok = (rows < BLOCK_Q * QPK) & (tok < q_len)
    d = tl.arange(0, HEAD_SIZE)
    q_rows = (q_begin + tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    qk_scale = scale * 1.4426950408889634  # the softmax runs in base 2
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE], tl.float32)

    if HAS_PREFIX:
        # The cached context [0, ctx_len): every row sees all of it (it precedes the chunk).
        ctx_len = tl.load(seq_lens_ptr + req) - q_len
        bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
        v_cache_ptr = k_cache_ptr + v_offset
        if OFF32:
            kv_head_off = kv_head * stride_ch
        else:
            kv_head_off = kv_head.to(tl.int64) * stride_ch
        d_ok = d < HEAD_SIZE
        pos_q = ctx_len + tok
        slope = tl.zeros([BLOCK_M], tl.float32)
        full = ctx_len // TILE_N
        for t in range(0, full):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, t, bt_row, k_cache_ptr, v_cache_ptr, kv_head_off, stride_cb,
                stride_cs, d, d_ok, row_ok, pos_q, 0, ctx_len, slope, scale, qk_scale,
                1.0, 0, HEAD_SIZE, HEAD_SIZE, BLOCK_SIZE, TILE_N, False, False,
                False, False, DOT_FP32, False, OFF32,
            )
        for t in range(full, tl.cdiv(ctx_len, TILE_N)):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, t, bt_row, k_cache_ptr, v_cache_ptr, kv_head_off, stride_cb,
                stride_cs, d, d_ok, row_ok, pos_q, 0, ctx_len, slope, scale, qk_scale,
                1.0, 0, HEAD_SIZE, HEAD_SIZE, BLOCK_SIZE, TILE_N, False, False,
                False, False, DOT_FP32, True, OFF32,
            )

    # The chunk's own keys j in [0, q_len), at descriptor rows q_begin + j.
    col = kv_head * HEAD_SIZE
    if DIAG_N > 0:
        # Keys below q_off are visible to every row (q_off is a multiple of DIAG_N).
        big_hi = q_off // TILE_N
        for t in tl.range(0, big_hi, num_stages=INNER_STAGES, warp_specialize=WARP_SPECIALIZE):
            m_i, l_i, acc = _own_tile(
                q, m_i, l_i, acc, k_desc, v_desc, q_begin, col, t * TILE_N, tok, q_len,
                qk_scale, TILE_N, CAUSAL, False, DOT_FP32,
            )
        for t in tl.range(big_hi * (TILE_N // DIAG_N), q_off // DIAG_N,
                          num_stages=EDGE_STAGES):
            m_i, l_i, acc = _own_tile(
                q, m_i, l_i, acc, kd_desc, vd_desc, q_begin, col, t * DIAG_N, tok, q_len,
                qk_scale, DIAG_N, CAUSAL, False, DOT_FP32,
            )
        last = (tl.minimum(q_off + BLOCK_Q, q_len) - 1) // DIAG_N + 1
        for t in tl.range(q_off // DIAG_N, last, num_stages=EDGE_STAGES):
            m_i, l_i, acc = _own_tile(
                q, m_i, l_i, acc, kd_desc, vd_desc, q_begin, col, t * DIAG_N, tok, q_len,
                qk_scale, DIAG_N, CAUSAL, True, DOT_FP32,
            )
    elif CAUSAL:
        full_hi = (q_off + 1) // TILE_N  # tiles every row of the q-block fully sees
        hi = (tl.minimum(q_off + BLOCK_Q, q_len) - 1) // TILE_N + 1
    else:
        full_hi = q_len // TILE_N
        hi = tl.cdiv(q_len, TILE_N)
    if DIAG_N == 0:
        for t in tl.range(0, full_hi, num_stages=INNER_STAGES,
                          warp_specialize=WARP_SPECIALIZE):
            m_i, l_i, acc = _own_tile(
                q, m_i, l_i, acc, k_desc, v_desc, q_begin, col, t * TILE_N, tok, q_len,
                qk_scale, TILE_N, CAUSAL, False, DOT_FP32,
            )
        for t in tl.range(full_hi, hi, num_stages=EDGE_STAGES):
            m_i, l_i, acc = _own_tile(
                q, m_i, l_i, acc, k_desc, v_desc, q_begin, col, t * TILE_N, tok, q_len,
                qk_scale, TILE_N, CAUSAL, True, DOT_FP32,
            )

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


@triton.jit
def prefill_tma_ws_kernel(
    out_ptr,
    q_ptr,
    k_desc,
    v_desc,
    qsl_ptr,
    num_reqs,
    scale,
    token_end,
    q_width,
    stride_qt,
    stride_ot,
    stride_oh,
    HEAD_SIZE: tl.constexpr,
    QPK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    STAGES: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    HEADS_FAST: tl.constexpr = False,
):
    """Prefill without a cached prefix, written for Triton's Hopper warp specialization.

    Grid ``(q_blocks, Hq)`` (``(Hq, q_blocks)`` with ``HEADS_FAST``): a program owns
    ``BLOCK_M`` query tokens of one query head (no GQA packing: its K/V tiles are re-read
    by the ``QPK`` heads of the group, from L2), longest q-block first (`_ws_q_block`).

    `q_ptr`: the step's ``query``, read as ``[token_end, q_width = Hq * HEAD_SIZE]`` (row
    stride `stride_qt`) in ``[BLOCK_M, HEAD_SIZE]`` blocks; `k_desc` / `v_desc`: ``key`` /
    ``value`` as ``[token_end, Hkv * HEAD_SIZE]`` with ``[TILE_N, HEAD_SIZE]`` blocks. Rows
    past a request are the next request's (finite) or TMA's zero fill past `token_end`; they
    reach only rows that are not stored or keys that are masked.
    """
    if HEADS_FAST:
        head = tl.program_id(0)
        q_block_id = tl.num_programs(1) - 1 - tl.program_id(1)  # longest first
    else:
        head = tl.program_id(1)
        q_block_id = tl.num_programs(0) - 1 - tl.program_id(0)
    # Built here, not on the host: the warp specialization splits the query load between
    # the two consumer warpgroups (64 rows each) and rewrites the descriptor's box to match;
    # a host descriptor keeps its 128-row box and overruns the halves (it hung on the H200).
    q_desc = tl.make_tensor_descriptor(q_ptr, [token_end, q_width], [stride_qt, 1],
                                       [BLOCK_M, HEAD_SIZE])
    _ws_q_block(
        out_ptr, q_desc, k_desc, v_desc, qsl_ptr, num_reqs, scale, stride_ot, stride_oh,
        q_block_id, head, HEAD_SIZE, QPK, BLOCK_M, TILE_N, CAUSAL, DOT_FP32, SEARCH_STEPS,
        STAGES, WARP_SPECIALIZE,
    )


@triton.jit
def prefill_tma_ws_persistent_kernel(
    out_ptr,
    q_ptr,
    k_desc,
    v_desc,
    qsl_ptr,
    num_reqs,
    scale,
    token_end,
    q_width,
    stride_qt,
    stride_ot,
    stride_oh,
    num_heads,
    num_q_blocks,
    HEAD_SIZE: tl.constexpr,
    QPK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    STAGES: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    """`prefill_tma_ws_kernel` as a persistent kernel: grid ``(P,)`` with ``P`` at most the
    number of work items ``num_heads * num_q_blocks`` (the device's SM count, one program
    per SM), each program serving items ``pid, pid + P, ...`` in the order of the ``HEADS_FAST``
    grid (every head of the longest q-block first), so that a program's next item starts
    while the SM still holds its shared memory, and no program waits for a launch slot.
    ``WARP_SPECIALIZE`` specializes the key loop of each item, as in the non-persistent
    kernel. On an H100 it ran as fast as that kernel, no faster (tuning flag ``wsk,p``)."""
    pid = tl.program_id(0)
    q_desc = tl.make_tensor_descriptor(q_ptr, [token_end, q_width], [stride_qt, 1],
                                       [BLOCK_M, HEAD_SIZE])
    for item in tl.range(pid, num_heads * num_q_blocks, tl.num_programs(0)):
        head = item % num_heads
        q_block_id = num_q_blocks - 1 - item // num_heads  # longest first
        _ws_q_block(
            out_ptr, q_desc, k_desc, v_desc, qsl_ptr, num_reqs, scale, stride_ot, stride_oh,
            q_block_id, head, HEAD_SIZE, QPK, BLOCK_M, TILE_N, CAUSAL, DOT_FP32,
            SEARCH_STEPS, STAGES, WARP_SPECIALIZE,
        )


@triton.jit
def _ws_q_block(
    out_ptr, q_desc, k_desc, v_desc, qsl_ptr, num_reqs, scale, stride_ot, stride_oh,
    q_block_id, head,
    HEAD_SIZE: tl.constexpr,
    QPK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    STAGES: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    """Query block `q_block_id` (numbered over the launch, ``num_reqs`` spare ones among
    them) of query head `head`: ``BLOCK_M`` query tokens against their keys.

    Every load is a tensor-descriptor (TMA) load and the key loop is one branch-free loop
    (the causal mask applied to every tile), the form in which Triton 3.6 splits the
    program into a producer warpgroup and consumer warpgroups (``WARP_SPECIALIZE``); a
    second loop, an ``if`` inside the loop or a plain pointer load make its pass fail or
    leave the kernel unspecialized. The request search is a binary search unrolled into
    ``SEARCH_STEPS`` (`num_reqs`'s bit length) steps for the same reason; spare q-blocks run
    one tile and store nothing."""
    kv_head = head // QPK
    # The request: a binary search of `_find_request`, unrolled (scalar loads
    # only: no loop and no cross-warp reduction, which the warp partitions could not share).
    base = tl.load(qsl_ptr) // BLOCK_M
    lo = 0
    hi = num_reqs
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        first = tl.load(qsl_ptr + mid) // BLOCK_M - base + mid
        active = lo < hi
        right = active & (first <= q_block_id)
        left = active & (first > q_block_id)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(left, mid, hi)
    req = lo - 1
    q_begin = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_begin
    first_block = q_begin // BLOCK_M - base + req
    q_off = tl.minimum((q_block_id - first_block) * BLOCK_M, q_len)

    rows = tl.arange(0, BLOCK_M)
    tok = q_off + rows
    q = q_desc.load([q_begin + q_off, head * HEAD_SIZE])
    if DOT_FP32:
        q = q.to(tl.float32)
    qk_scale = scale * 1.4426950408889634  # the softmax runs in base 2
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE], tl.float32)
    col = kv_head * HEAD_SIZE
    # The last key each row sees: one compare per score.
    if CAUSAL:
        hi = tl.cdiv(tl.minimum(q_off + BLOCK_M, q_len), TILE_N)
        last = tl.minimum(tok, q_len - 1)
    else:
        hi = tl.cdiv(q_len, TILE_N)
        last = tl.zeros([BLOCK_M], tl.int32) + (q_len - 1)
    # A spare q-block runs one tile (stores nothing): a warp-specialized loop that runs no
    # iteration would leave the query's TMA load in flight at exit.
    hi = tl.where(q_off < q_len, hi, 1)
    for t in tl.range(0, hi, num_stages=STAGES, warp_specialize=WARP_SPECIALIZE):
        k = k_desc.load([q_begin + t * TILE_N, col])
        if DOT_FP32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        j = t * TILE_N + tl.arange(0, TILE_N)
        s = tl.where(j[None, :] <= last[:, None], s, float("-inf"))
        # Key 0 is in the first tile and visible to every row: m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = v_desc.load([q_begin + t * TILE_N, col])
        if DOT_FP32:
            acc = tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new

    out = acc / l_i[:, None]
    d = tl.arange(0, HEAD_SIZE)
    q_rows = (q_begin + tok).to(tl.int64)
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=(tok < q_len)[:, None],
    )
