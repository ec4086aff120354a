# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Triton kernels for multi-head latent attention (MLA) over a paged latent cache.

The cache is ``[num_blocks, block_size, L + R]``: one row per token holding the compressed
latent ``c`` (``L`` values, which are also the values) and the roped shared key ``k_pe``
(``R`` values). One program serves one query token and ``BLOCK_H`` query heads: every cache
row it loads is shared by all those heads (the point of MLA: one latent "head"), scores are
``dot(q_lat, c) + dot(q_pe, k_pe)`` (the 576 dims as 512 + 64, no padding to 1024), the online
softmax runs in base 2 with the scale folded into one multiply, and the output accumulates
``p @ c`` in latent space (``[BLOCK_H, L]``) inside the MMA.

Each token sees the first ``kv_len`` positions of its request (``kv_len`` = context + its index
in the step + 1: causal aligned to the end), so one kernel serves decodes and prefill tokens of a
mixed batch. With ``WRITE_PARTIAL`` (split-KV, for long contexts with few tokens) the positions
are cut into ``split_len``-token segments computed by separate programs that write partial
``(acc / sum, max, sum)`` in fp32; `pagedcore_triton.mla_merge.mla_merge_kernel` combines them.
With ``FANIN`` (``MLAKernelConfig.fused_fanin``) there is no merge kernel: the split programs
merge among themselves as a tree of that fan-in. Each writes its unnormalised partial and
increments its group's counter (``atomic_add``, acquire-release, after a barrier so that every
thread's stores precede the release); the group's last arrival reads the other partials from
L2 (``.cg`` loads), combines them with its own registers, resets the counter to zero for the
next launch (no host work per call: CUDA-graph safe) and goes one level up; the root's last
arrival writes the output. No program ever waits for another, so any launch order is safe.

Speed notes (H200, bf16, DeepSeek-V2-Lite shapes; from the TTGIR/SASS of Triton 3.6 for sm_90
and the bench in ``docs/mla.md``):

* Triton's software pipeliner puts the block-table load of a tile one stage before the row
  loads that depend on it, so ``num_stages`` 2-4 leave the row tile single-buffered (loaded
  after the previous tile's MMAs and waited for at once). ``num_stages=5`` double-buffers the
  rows (the next tile is in flight during the MMAs), ``7`` triple-buffers them.
* With 16 query rows, the score MMA of a tile over all 576 dims is one chain of 36 dependent
  ``mma.sync`` per warp. ``LAT_SPLIT=4`` cuts the latent into four column chunks with their own
  loads, MMAs and accumulators: five short independent chains, and half the instructions per
  tile (smaller address tensors).
* The split-KV shapes lose most to fixed costs around the merge. Programmatic dependent launch
  (``USE_PDL``: the merge's programs are placed during the decode kernel's tail and wait with
  ``griddepcontrol.wait``) and reading up to 64 splits' partials in one round trip
  (``CHUNK`` = the split count, where the old merge made 4 dependent trips for 64 splits) gave
  +2.3 and +2.6 points of copy bandwidth at 64 x 4096 and 128 x 2048, +1.0 at 16 x 16384,
  +8.2 at 4 x 32768, and +1.4 at the unsplit 256 x 1024 (the gap between steps).
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedcore_triton.mla_tiles import (
    _attend,
    _clock,
    _now,
    _peer_cols,
    _queries,
    _smid,
    _store_cols,
    _store_partial,
    _store_scaled,
    _weight,
)

__all__ = ["mla_cache_write_kernel", "mla_decode_kernel"]


@triton.jit(do_not_specialize=["num_splits"])
def mla_decode_kernel(
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    counter_ptr,
    probe_ptr,
    q_ptr,
    cache_ptr,
    block_table_ptr,
    token_req_ptr,
    token_kv_len_ptr,
    k_scale_ptr,
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
    SPLIT_FIRST: tl.constexpr = False,
    FANIN: tl.constexpr = 0,
    PROBE: tl.constexpr = False,
    HEADS_PER_PROG: tl.constexpr = 0,
    ROWSUM_2D: tl.constexpr = False,
    KV_FP8: tl.constexpr = False,
    Q_F16: tl.constexpr = False,
):
    """Grid ``(tokens, cdiv(H, BLOCK_H), num_splits)``, or ``(num_splits, cdiv(H, BLOCK_H),
    tokens)`` with `SPLIT_FIRST` (the splits of one token launched next to each other); see
    the module docstring.

    The latent dims are handled as ``LAT_SPLIT`` (1, 2 or 4) column chunks of
    ``LATENT_PAD // LAT_SPLIT``, each with its own load, score MMA and accumulator, so the
    score MMAs form short independent chains instead of one chain over all 576 dims.

    ``HEADS_PER_PROG`` (0 = ``BLOCK_H``): query heads per program; fewer than ``BLOCK_H``
    masks the MMA's other rows (``MLAKernelConfig.narrow_heads``). ``ROWSUM_2D``: the row
    sums are kept as a ``[BLOCK_H, BLOCK_N]`` tile and summed once after the loop
    (``MLAKernelConfig.rowsum_2d``). With ``PROBE`` (a
    diagnostic build, never the shipped one) each program writes ``[smid, t_start, t_go,
    t_loop, t_end, tiles, cycles, 0]`` int64 to ``probe_ptr`` row ``(tok * head blocks +
    head_block) * num_splits + split``: ``%globaltimer`` ns at its start, after the PDL wait,
    after its last tile and after its last store, and its ``%clock64`` cycles from start
    to end.

    ``KV_FP8``: the cache holds ``fp8(row / k_scale)`` (``[1]`` float32 at `k_scale_ptr`, read
    on the device, so a captured graph sees a later calibration): ``k_scale`` is folded into
    the score scale and into the latent output (or the unfused merge's partials), never into
    a dequantized copy of the cache. ``Q_F16`` (fp8 caches with 16-bit queries): queries and
    cache tiles enter the MMAs as float16 (see `_queries`).
    """
    CW: tl.constexpr = LATENT_PAD // LAT_SPLIT
    if PROBE:
        t_start = _now()
        c_start = _clock()
    if USE_PDL:  # launched with programmatic dependent launch: inputs of the prior kernel
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if SPLIT_FIRST:
        split = tl.program_id(0)
        tok = tl.program_id(2)
    else:
        tok = tl.program_id(0)
        split = tl.program_id(2)
    head_block = tl.program_id(1)
    if PROBE:
        t_go = _now()

    value_scale = 1.0
    if KV_FP8:
        value_scale = tl.load(k_scale_ptr)
        scale_log2 = scale_log2 * value_scale
    req = tl.load(token_req_ptr + tok)
    kv_len = tl.load(token_kv_len_ptr + tok)
    start = split * split_len
    end = tl.minimum(start + split_len, kv_len)

    if HEADS_PER_PROG > 0:
        heads = head_block * HEADS_PER_PROG + tl.arange(0, BLOCK_H)
        head_mask = (tl.arange(0, BLOCK_H) < HEADS_PER_PROG) & (heads < num_heads)
    else:
        heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
        head_mask = heads < num_heads
    q_pe, q0, q1, q2, q3 = _queries(q_ptr, tok, heads, head_mask, stride_qt, stride_qh,
                                    LATENT, LATENT_PAD, LAT_SPLIT, ROPE, ROPE_PAD, DOT_FP32,
                                    Q_F16)
    table_row = block_table_ptr + req.to(tl.int64) * stride_bt
    m_i, l_i, acc0, acc1, acc2, acc3 = _attend(
        q_pe, q0, q1, q2, q3, cache_ptr, table_row, start, end, stride_cb, stride_cs,
        scale_log2, LATENT, LATENT_PAD, LAT_SPLIT, ROPE, ROPE_PAD, BLOCK_SIZE, BLOCK_H,
        BLOCK_N, DOT_FP32, ROWSUM_2D, KV_FP8)
    if PROBE:
        t_loop = _now()

    rows_ok = head_mask
    if WRITE_PARTIAL and FANIN > 0:
        # Merge fused into the last-finishing programs, as a tree of fan-in FANIN. Partial
        # slots of one (token, head block): num_splits at level 0, then one per group of
        # each level ([T, head blocks, 2 * num_splits, BLOCK_H, LATENT_PAD], unnormalised,
        # with (max, sum) as [..., BLOCK_H, 2]); one int32 counter per group (fewer than
        # num_splits per pair), zero between launches: the group's last arrival resets it.
        hl = tl.arange(0, BLOCK_H)
        pair = tok.to(tl.int64) * tl.num_programs(1) + head_block
        slot0 = pair * 2 * num_splits
        ctr0 = pair * num_splits
        node = split
        width = num_splits + 0 * split
        lvl_slot = 0 * split
        lvl_ctr = 0 * split
        alive = split >= 0
        while alive & (width > 1):
            rows = (slot0 + lvl_slot + node) * BLOCK_H + hl
            tl.store(part_ml_ptr + rows * 2, m_i)
            tl.store(part_ml_ptr + rows * 2 + 1, l_i)
            own = part_acc_ptr + rows[:, None] * LATENT_PAD
            _store_cols(own, acc0, 0, head_mask, LATENT_PAD, CW)
            if LAT_SPLIT >= 2:
                _store_cols(own, acc1, CW, head_mask, LATENT_PAD, CW)
            if LAT_SPLIT == 4:
                _store_cols(own, acc2, 2 * CW, head_mask, LATENT_PAD, CW)
                _store_cols(own, acc3, 3 * CW, head_mask, LATENT_PAD, CW)
            # Every thread's stores before the (one-thread) release of the counter.
            tl.debug_barrier()
            first = (node // FANIN) * FANIN
            n_in = tl.minimum(width - first, FANIN)
            ctr = counter_ptr + ctr0 + lvl_ctr + node // FANIN
            alive = tl.atomic_add(ctr, 1, sem="acq_rel", scope="gpu") == n_in - 1
            if alive:  # the group's last arrival: the others' partials are in L2
                tl.store(ctr, 0)
                peers = first + tl.arange(0, FANIN)
                ok = (peers < first + n_in) & (peers != node)
                prow = (slot0 + lvl_slot + peers)[:, None] * BLOCK_H + hl[None, :]
                m_p = tl.load(part_ml_ptr + prow * 2, mask=ok[:, None], other=float("-inf"),
                              cache_modifier=".cg")
                l_p = tl.load(part_ml_ptr + prow * 2 + 1, mask=ok[:, None], other=0.0,
                              cache_modifier=".cg")
                m_new = tl.maximum(m_i, tl.max(m_p, axis=0))
                w_own = _weight(m_i, m_new)
                l_i = l_i * w_own + tl.sum(l_p * _weight(m_p, m_new[None, :]), axis=0)
                acc0 = acc0 * w_own[:, None]
                if LAT_SPLIT >= 2:
                    acc1 = acc1 * w_own[:, None]
                if LAT_SPLIT == 4:
                    acc2 = acc2 * w_own[:, None]
                    acc3 = acc3 * w_own[:, None]
                for j in range(first, first + n_in):
                    rows_j = (slot0 + lvl_slot + j) * BLOCK_H + hl
                    ok_j = head_mask & ((hl * 0 + j) != node)
                    acc0 += _peer_cols(part_acc_ptr, part_ml_ptr, rows_j, ok_j, m_new, 0,
                                       LATENT_PAD, CW)
                    if LAT_SPLIT >= 2:
                        acc1 += _peer_cols(part_acc_ptr, part_ml_ptr, rows_j, ok_j, m_new, CW,
                                           LATENT_PAD, CW)
                    if LAT_SPLIT == 4:
                        acc2 += _peer_cols(part_acc_ptr, part_ml_ptr, rows_j, ok_j, m_new,
                                           2 * CW, LATENT_PAD, CW)
                        acc3 += _peer_cols(part_acc_ptr, part_ml_ptr, rows_j, ok_j, m_new,
                                           3 * CW, LATENT_PAD, CW)
                m_i = m_new
            lvl_slot += width
            lvl_ctr += tl.cdiv(width, FANIN)
            node = node // FANIN
            width = tl.cdiv(width, FANIN)
        # Only the root's last arrival writes the output. (Broadcast by a compare: the
        # interpreter turns ``bool[BLOCK_H] & bool`` into int32.)
        rows_ok = head_mask & ((heads * 0 + alive.to(tl.int32)) != 0)
    if WRITE_PARTIAL and FANIN == 0:
        part = (tok.to(tl.int64) * num_heads + heads) * num_splits + split
        _store_partial(part_acc_ptr, part_ml_ptr, part, head_mask, m_i, l_i, acc0, acc1, acc2,
                       acc3, LATENT_PAD, LAT_SPLIT, value_scale)
    else:
        ptrs = out_ptr + (tok.to(tl.int64) * stride_ot + heads * stride_oh)[:, None]
        if FANIN > 0:  # (the programs that write nothing may hold a sum of 0)
            scale = value_scale / tl.where(rows_ok, l_i, 1.0)
        else:
            scale = value_scale / l_i
        _store_scaled(ptrs, scale, rows_ok, LATENT, acc0, acc1, acc2, acc3, LATENT_PAD,
                      LAT_SPLIT)
    if PROBE:
        t_end = _now()
        c_end = _clock()
        if SPLIT_FIRST:
            n_splits = tl.num_programs(0)
        else:
            n_splits = tl.num_programs(2)
        prow = probe_ptr + ((tok.to(tl.int64) * tl.num_programs(1) + head_block) * n_splits
                            + split) * 8
        tl.store(prow, _smid().to(tl.int64))
        tl.store(prow + 1, t_start)
        tl.store(prow + 2, t_go)
        tl.store(prow + 3, t_loop)
        tl.store(prow + 4, t_end)
        tl.store(prow + 5, (tl.maximum(end - start, 0) + BLOCK_N - 1) // BLOCK_N)
        tl.store(prow + 6, c_end - c_start)


@triton.jit
def mla_cache_write_kernel(
    key_ptr,
    cache_ptr,
    slot_ptr,
    k_scale_ptr,
    stride_kt,
    stride_cb,
    stride_cs,
    DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANT_MAX: tl.constexpr = None,
):
    """Grid ``(tokens,)``: copy token ``t``'s row ``key[t, 0, :DIM]`` into its cache slot.

    Slot ``-1`` (padding) is skipped on the device, so no host sync and no write anywhere.
    With ``QUANT_MAX`` (an fp8 cache) the row is stored as ``clamp(x / k_scale, -QUANT_MAX,
    QUANT_MAX)`` rounded to the cache's fp8 dtype (``[1]`` float32 at `k_scale_ptr`).
    """
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, DIM_PAD)
        mask = offs < DIM
        row = tl.load(key_ptr + tok.to(tl.int64) * stride_kt + offs, mask=mask)
        if QUANT_MAX is not None:
            row = tl.clamp(row.to(tl.float32) / tl.load(k_scale_ptr), -QUANT_MAX, QUANT_MAX)
        dst = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
        tl.store(dst + offs, row.to(cache_ptr.dtype.element_ty), mask=mask)
