"""A lane-by-lane Python model of the tensor-core kernels' index arithmetic.

`csrc/decode_mma.cuh` and `csrc/prefill_mma.cuh` hand fragments between `mma.m16n8k16`,
`ldmatrix` and memory with permuted key / head-dim orders. This module replays their loops
per lane with the fragment layouts of the PTX ISA (`mma_16816`, `ldmatrix_x4` below), so the
CPU tests can check the permutations, masks and edge zeroing against the reference without a
GPU. It mirrors the kernels statement for statement; keep the two in step.

A 32-bit register is modelled as a pair ``(lo, hi)`` of floats.
"""

from __future__ import annotations

import math
from typing import Any

import torch

Reg = tuple[float, float]
ZERO: Reg = (0.0, 0.0)
NEG = -math.inf


def _vec(t: torch.Tensor) -> list[Reg]:
    """A vector of 2k elements as k registers."""
    v = t.tolist()
    return [(v[i], v[i + 1]) for i in range(0, len(v), 2)]


def mma_16816(a: list[list[Reg]], b: list[list[Reg]], c: list[list[float]]) -> list[list[float]]:
    """d = A B + C for one warp; a[lane][4], b[lane][2], c[lane][4] in the PTX layouts."""
    am = torch.zeros(16, 16, dtype=torch.float64)
    bm = torch.zeros(16, 8, dtype=torch.float64)
    cm = torch.zeros(16, 8, dtype=torch.float64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for reg, (r, k) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8),
                                      (g + 8, 2 * t + 8)]):
            am[r, k], am[r, k + 1] = a[lane][reg]
        for reg, k in enumerate([2 * t, 2 * t + 8]):
            bm[k, g], bm[k + 1, g] = b[lane][reg]
        cm[g, 2 * t], cm[g, 2 * t + 1], cm[g + 8, 2 * t], cm[g + 8, 2 * t + 1] = c[lane]
    dm = am @ bm + cm
    return [[float(dm[lane // 4, 2 * (lane % 4)]), float(dm[lane // 4, 2 * (lane % 4) + 1]),
             float(dm[lane // 4 + 8, 2 * (lane % 4)]),
             float(dm[lane // 4 + 8, 2 * (lane % 4) + 1])] for lane in range(32)]


def ldmatrix_x4(mem: torch.Tensor, addr: list[tuple[int, int]]) -> list[list[Reg]]:
    """Four 8x8 matrices; lane i gives (row, col) of row i % 8 of matrix i // 8 in `mem`."""
    out: list[list[Reg]] = [[] for _ in range(32)]
    for m in range(4):
        rows = [mem[addr[8 * m + i][0], addr[8 * m + i][1]:addr[8 * m + i][1] + 8]
                for i in range(8)]
        for lane in range(32):
            row = rows[lane // 4]
            out[lane].append((float(row[2 * (lane % 4)]), float(row[2 * (lane % 4) + 1])))
    return out


def _quad_max(x: list[float]) -> list[float]:
    return [max(x[(lane // 4) * 4 + i] for i in range(4)) for lane in range(32)]


def _exp2(x: float) -> float:
    return 0.0 if x == NEG else 2.0**x


def _transform(s: float, scale: float, cap: float, slope: float, pos_k: int,
               pos_q: int) -> float:
    s = s * scale
    if cap > 0:
        s = cap * math.tanh(s / cap)
    return s + slope * (pos_k - pos_q)


def _merge_warps(m_s: list[list[float]], l_s: list[list[float]], o_s: list[torch.Tensor],
                 rows: int) -> tuple[torch.Tensor, list[float], list[float]]:
    """csrc/decode_merge.cuh `write_merged_rows`: the warps' states of `rows` heads merged,
    ``(out [rows, D], max (natural), sum)``."""
    log2e = 1 / math.log(2)
    out = torch.zeros(rows, o_s[0].shape[1], dtype=torch.float64)
    mxs, sums = [], []
    for row in range(rows):
        mx = max(m[row] for m in m_s)
        total, acc = 0.0, torch.zeros(o_s[0].shape[1], dtype=torch.float64)
        for m, lw, o in zip(m_s, l_s, o_s, strict=True):
            f = 0.0 if m[row] == NEG else _exp2(m[row] - mx)
            total += f * lw[row]
            acc += f * o[row]
        out[row] = acc / total if total > 0 else 0.0
        mxs.append(mx / log2e if mx != NEG else NEG)
        sums.append(total)
    return out, mxs, sums


def decode_mma(q: torch.Tensor, k_view: torch.Tensor, v_view: torch.Tensor,
               bt: list[int], seq_len: int, *, kv_head: int, group: int, chunk: int,
               ctx_start: int, p_begin: int, p_end: int, scale: float, cap: float,
               slopes: list[float] | None, nw: int = 4,
               unroll: int = 1) -> tuple[torch.Tensor, list[float], list[float]]:
    """One thread block of decode_mma_kernel: ``(out [rows, D], max (natural), sum)``.

    `q` is ``[Hq, D]`` of the decode token; `k_view` / `v_view` the layout views.
    """
    head_dim = q.shape[1]
    block = v_view.shape[-1]
    chunks, nt_count = head_dim // 8, head_dim // 8
    pairs = (chunks + 3) // 4
    head0 = kv_head * group + chunk * 16
    rows = min(16, kv_head * group + group - head0)
    pos_q = seq_len - 1
    n_tiles = -(-(p_end - p_begin) // 16)
    log2e = 1 / math.log(2)
    m_s, l_s, o_s = [], [], []
    for warp in range(nw):
        qa = [[[[ZERO] * 4 for _ in range(2)] for _ in range(pairs)] for _ in range(32)]
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for pr in range(pairs):
                c = 4 * pr + t
                lo = hi = [ZERO] * 4
                if c < chunks:
                    if g < rows:
                        lo = _vec(q[head0 + g, c * 8:c * 8 + 8])
                    if g + 8 < rows:
                        hi = _vec(q[head0 + g + 8, c * 8:c * 8 + 8])
                qa[lane][pr][0] = [lo[0], hi[0], lo[1], hi[1]]
                qa[lane][pr][1] = [lo[2], hi[2], lo[3], hi[3]]
        o = [[[0.0] * 4 for _ in range(nt_count)] for _ in range(32)]
        m = [[NEG, NEG] for _ in range(32)]
        lsum = [[0.0, 0.0] for _ in range(32)]
        for it in range(warp, n_tiles, nw * unroll):
            for u in range(unroll):
                tile = it + u * nw
                if tile >= n_tiles:
                    break
                kb = p_begin + tile * 16
                kr = [[[[ZERO] * 4 for _ in range(pairs)] for _ in range(2)] for _ in range(32)]
                vr = [[(ZERO, ZERO)] * nt_count for _ in range(32)]
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    for nt in range(2):
                        key = kb + 4 * (g // 2) + 2 * nt + (g & 1)
                        if ctx_start <= key < p_end:
                            phys = bt[key // block]
                            for pr in range(pairs):
                                c = 4 * pr + t
                                if c < chunks:
                                    kr[lane][nt][pr] = _vec(k_view[phys, kv_head, c, key % block])
                    key0 = kb + 4 * t
                    if key0 + 4 > ctx_start and key0 < p_end:
                        phys = bt[key0 // block]
                        for j in range(nt_count):
                            row = v_view[phys, kv_head, 8 * j + g, key0 % block:key0 % block + 4]
                            vr[lane][j] = (_vec(row)[0], _vec(row)[1])
                s = []
                for nt in range(2):
                    acc = [[0.0] * 4 for _ in range(32)]
                    for pr in range(pairs):
                        for st in range(2):
                            a = [qa[lane][pr][st] for lane in range(32)]
                            b = [kr[lane][nt][pr][2 * st:2 * st + 2] for lane in range(32)]
                            acc = mma_16816(a, b, acc)
                    s.append(acc)
                pa = [[ZERO] * 4 for _ in range(32)]
                probs = [[[0.0] * 4 for _ in range(2)] for _ in range(32)]
                for r in range(2):
                    xs, mx = [], []
                    for lane in range(32):
                        g, t = lane // 4, lane % 4
                        key0 = kb + 4 * t
                        raw = [s[0][lane][2 * r], s[0][lane][2 * r + 1], s[1][lane][2 * r],
                               s[1][lane][2 * r + 1]]
                        slope = slopes[head0 + g + 8 * r] if slopes and g + 8 * r < rows else 0.0
                        x = [log2e * _transform(raw[i], scale, cap, slope, key0 + i, pos_q)
                             if ctx_start <= key0 + i < p_end else NEG for i in range(4)]
                        xs.append(x)
                        mx.append(max(x))
                    mx = _quad_max(mx)
                    for lane in range(32):
                        m_new = max(m[lane][r], mx[lane])
                        alpha = 1.0 if m_new == NEG else _exp2(m[lane][r] - m_new)
                        p = [0.0 if x == NEG else _exp2(x - m_new) for x in xs[lane]]
                        probs[lane][r] = p
                        lsum[lane][r] = lsum[lane][r] * alpha + sum(p)
                        m[lane][r] = m_new
                        for j in range(nt_count):
                            o[lane][j][2 * r] *= alpha
                            o[lane][j][2 * r + 1] *= alpha
                for lane in range(32):
                    p0, p1 = probs[lane]
                    pa[lane] = [(p0[0], p0[1]), (p1[0], p1[1]), (p0[2], p0[3]), (p1[2], p1[3])]
                for j in range(nt_count):
                    bs = []
                    for lane in range(32):
                        key0 = kb + 4 * (lane % 4)
                        vis = [ctx_start <= key0 + i < p_end for i in range(4)]
                        (a0, a1), (b0, b1) = vr[lane][j]
                        bs.append([(a0 if vis[0] else 0.0, a1 if vis[1] else 0.0),
                                   (b0 if vis[2] else 0.0, b1 if vis[3] else 0.0)])
                    d = mma_16816(pa, bs, [o[lane][j] for lane in range(32)])
                    for lane in range(32):
                        o[lane][j] = d[lane]
        # Per-warp results: rows 0..15.
        wm, wl = [NEG] * 16, [0.0] * 16
        wo = torch.zeros(16, head_dim, dtype=torch.float64)
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for r in range(2):
                quad = sum(lsum[(lane // 4) * 4 + i][r] for i in range(4))
                wm[g + 8 * r], wl[g + 8 * r] = m[lane][r], quad
                for j in range(nt_count):
                    wo[g + 8 * r, 8 * j + 2 * t] = o[lane][j][2 * r]
                    wo[g + 8 * r, 8 * j + 2 * t + 1] = o[lane][j][2 * r + 1]
        m_s.append(wm)
        l_s.append(wl)
        o_s.append(wo)
    return _merge_warps(m_s, l_s, o_s, rows)


def prefill_mma(q: torch.Tensor, k_view: torch.Tensor, v_view: torch.Tensor, bt: list[int], *,
                seq_len: int, q_len: int, row0: int, head: int, kv_head: int, scale: float,
                cap: float, slope: float, window: int, causal: bool = True,
                mt: int = 1, warp_mask: bool = False) -> torch.Tensor:
    """One thread block of prefill_mma_kernel: ``[rows, D]`` outputs of query rows
    ``row0..row0 + rows`` (`q` is the request's ``[q_len, Hq, D]``). Its `mt` m-tiles per
    warp are independent, so they are replayed as 4 * mt warps of 16 rows. `warp_mask`: the
    kernel's WMASK decisions per (real) warp of 16 * mt rows: a tile it skips is not visited,
    a tile it does not mask is computed without masks (so a wrong decision shows)."""
    head_dim = q.shape[2]
    block = v_view.shape[-1]
    ks_count, nt_count = head_dim // 16, head_dim // 8
    ctx = seq_len - q_len
    rows = min(64 * mt, q_len - row0)
    first_pos, last_pos = ctx + row0, ctx + row0 + rows - 1
    kv_lo = max(0, first_pos - window + 1) if window > 0 else 0
    kv_hi = min(seq_len, last_pos + 1) if causal else seq_len
    log2e = 1 / math.log(2)
    q_s = torch.zeros(64 * mt, head_dim, dtype=torch.float64)
    q_s[:rows] = q[row0:row0 + rows, head].double()
    kt_begin = (kv_lo // 64) * 64
    n_kt = -(-(kv_hi - kt_begin) // 64) if kv_hi > kt_begin else 0
    out = torch.zeros(rows, head_dim, dtype=torch.float64)
    for warp in range(4 * mt):
        qf = []
        for ks in range(ks_count):
            addr = [(warp * 16 + (lane // 8 % 2) * 8 + lane % 8, ks * 16 + (lane // 16) * 8)
                    for lane in range(32)]
            qf.append(ldmatrix_x4(q_s, addr))
        o = [[[0.0] * 4 for _ in range(nt_count)] for _ in range(32)]
        m = [[NEG, NEG] for _ in range(32)]
        lsum = [[0.0, 0.0] for _ in range(32)]
        for i in range(n_kt):
            kt = kt_begin + 64 * i
            need_mask = True
            if warp_mask:
                wfirst = first_pos + (warp // mt) * mt * 16
                wlast = min(wfirst + mt * 16 - 1, last_pos)
                if (wfirst > last_pos or (causal and kt > wlast)
                        or (window > 0 and kt + 63 <= wfirst - window)):
                    continue  # warp_skip
                need_mask = (kt < kv_lo or kt + 64 > kv_hi or (causal and kt + 63 > wfirst)
                             or (window > 0 and kt <= wlast - window))
            k_s = torch.zeros(64, head_dim, dtype=torch.float64)
            v_s = torch.zeros(head_dim, 64, dtype=torch.float64)
            for kk in range(64):
                pos = kt + kk
                if kv_lo <= pos < kv_hi:
                    k_s[kk] = k_view[bt[pos // block], kv_head, :, pos % block].reshape(-1)
            for kc in range(8):
                pos0 = kt + kc * 8
                if pos0 + 8 > kv_lo and pos0 < kv_hi:
                    blk = v_view[bt[pos0 // block], kv_head, :, pos0 % block:pos0 % block + 8]
                    v_s[:, kc * 8:kc * 8 + 8] = blk.double()
                    for j in range(8):  # the kernel's edge fix-up
                        if not kv_lo <= pos0 + j < kv_hi:
                            v_s[:, kc * 8 + j] = 0.0
            s = [[[0.0] * 4 for _ in range(32)] for _ in range(8)]
            for ks in range(ks_count):
                for j in range(0, 8, 2):
                    addr = [((j + lane // 16) * 8 + lane % 8, ks * 16 + (lane // 8 % 2) * 8)
                            for lane in range(32)]
                    r = ldmatrix_x4(k_s, addr)
                    s[j] = mma_16816(qf[ks], [r[ln][0:2] for ln in range(32)], s[j])
                    s[j + 1] = mma_16816(qf[ks], [r[ln][2:4] for ln in range(32)], s[j + 1])
            for r_ in range(2):
                vals, mx = [], []
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    pos_q = first_pos + warp * 16 + g + 8 * r_
                    row_vals = []
                    for j in range(8):
                        for e in range(2):
                            pos_k = kt + 8 * j + 2 * t + e
                            v = log2e * _transform(s[j][lane][2 * r_ + e], scale, cap, slope,
                                                   pos_k, pos_q)
                            vis = kv_lo <= pos_k < kv_hi
                            if causal:
                                vis = vis and pos_k <= pos_q
                            if window > 0:
                                vis = vis and pos_q - pos_k < window
                            row_vals.append(v if vis or not need_mask else NEG)
                    vals.append(row_vals)
                    mx.append(max(row_vals))
                mx = _quad_max(mx)
                for lane in range(32):
                    m_new = max(m[lane][r_], mx[lane])
                    alpha = 1.0 if m_new == NEG else _exp2(m[lane][r_] - m_new)
                    m_use = 0.0 if m_new == NEG else m_new
                    p = [_exp2(v - m_use) for v in vals[lane]]
                    for j in range(8):
                        for e in range(2):
                            s[j][lane][2 * r_ + e] = p[2 * j + e]
                    lsum[lane][r_] = lsum[lane][r_] * alpha + sum(p)
                    m[lane][r_] = m_new
                    for j in range(nt_count):
                        o[lane][j][2 * r_] *= alpha
                        o[lane][j][2 * r_ + 1] *= alpha
            for kk in range(4):
                a = [[(s[2 * kk][ln][0], s[2 * kk][ln][1]), (s[2 * kk][ln][2], s[2 * kk][ln][3]),
                      (s[2 * kk + 1][ln][0], s[2 * kk + 1][ln][1]),
                      (s[2 * kk + 1][ln][2], s[2 * kk + 1][ln][3])] for ln in range(32)]
                for n in range(0, nt_count, 2):
                    addr = [((n + lane // 16) * 8 + lane % 8, kk * 16 + (lane // 8 % 2) * 8)
                            for lane in range(32)]
                    r = ldmatrix_x4(v_s, addr)
                    for jj, sl in ((n, slice(0, 2)), (n + 1, slice(2, 4))):
                        d = mma_16816(a, [r[ln][sl] for ln in range(32)],
                                      [o[ln][jj] for ln in range(32)])
                        for ln in range(32):
                            o[ln][jj] = d[ln]
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for r_ in range(2):
                row = warp * 16 + g + 8 * r_
                total = sum(lsum[(lane // 4) * 4 + i][r_] for i in range(4))
                if row >= rows:
                    continue
                inv = 1.0 / total if total > 0 else 0.0
                for j in range(nt_count):
                    out[row, 8 * j + 2 * t] = o[lane][j][2 * r_] * inv
                    out[row, 8 * j + 2 * t + 1] = o[lane][j][2 * r_ + 1] * inv
    return out


def gather_plan(head_dim: int, block: int, bt: list[int], kt: int, kv_lo: int, kv_hi: int,
                *, pipelined: bool, num_kv_heads: int = 3, kv_head: int = 1,
                threads: int = 128, keys: int = 64) -> dict[tuple[str, int, int], int | None]:
    """Where each 16-byte vector of one K / V^T shared-memory tile comes from, as prefill_mma's
    two gathers compute it: ``{(tensor, smem row, smem col): element offset in the cache
    half, or None for a zero fill}``. ``pipelined`` mirrors `load_kv_pipe` (per-thread fixed
    key / group, shift and mask; `threads` per block and `keys` per tile are its template
    parameters NW * 32 and KN, the last trip guarded), otherwise `load_kv` (per-vector
    division)."""
    ch = head_dim // 8
    blk_stride, head_off = num_kv_heads * head_dim * block, kv_head * head_dim * block
    out: dict[tuple[str, int, int], int | None] = {}
    if not pipelined:
        for i in range(keys * ch):
            kk, c = i % keys, i // keys
            pos = kt + kk
            ok = kv_lo <= pos < kv_hi
            src = (bt[pos // block] * blk_stride + head_off + (c * block + pos % block) * 8)
            out[("k", kk, c * 8)] = src if ok else None
        for i in range(head_dim * (keys // 8)):
            kc, d = i % (keys // 8), i // (keys // 8)
            pos0 = kt + kc * 8
            ok = pos0 + 8 > kv_lo and pos0 < kv_hi
            src = bt[pos0 // block] * blk_stride + head_off + d * block + pos0 % block
            out[("v", d, kc * 8)] = src if ok else None
        return out
    shift = block.bit_length() - 1
    for tid in range(threads):
        k_kk, k_c0 = tid % keys, tid // keys
        v_kc, v_d0 = tid % (keys // 8), tid // (keys // 8)
        pos = kt + k_kk
        kph = bt[pos >> shift] if kv_lo <= pos < kv_hi else -1
        pos0 = kt + v_kc * 8
        vph = bt[pos0 >> shift] if pos0 + 8 > kv_lo and pos0 < kv_hi else -1
        kbase = max(kph, 0) * blk_stride + head_off + (((kt + k_kk) & (block - 1)) * 8
                                                        if kph >= 0 else 0)
        k_step, v_step = threads // keys, threads // (keys // 8)
        for r in range(-(-ch // k_step)):
            c = k_c0 + r * k_step
            if c < ch:
                out[("k", k_kk, c * 8)] = kbase + c * block * 8 if kph >= 0 else None
        vbase = max(vph, 0) * blk_stride + head_off + ((kt + v_kc * 8) & (block - 1)
                                                       if vph >= 0 else 0)
        for r in range(-(-head_dim // v_step)):
            d = v_d0 + r * v_step
            if d < head_dim:
                out[("v", d, v_kc * 8)] = vbase + d * block if vph >= 0 else None
    return out


def movmatrix_trans(x: list[Reg]) -> list[Reg]:
    """``movmatrix.m8n8.trans.b16``: lane holds row lane // 4, columns 2 (lane % 4) and +1."""
    mat = [[0.0] * 8 for _ in range(8)]
    for lane in range(32):
        g, t = lane // 4, lane % 4
        mat[g][2 * t], mat[g][2 * t + 1] = x[lane]
    return [(mat[2 * (lane % 4)][lane // 4], mat[2 * (lane % 4) + 1][lane // 4])
            for lane in range(32)]


def decode_fp8_keys(q: torch.Tensor, k_view: torch.Tensor, v_view: torch.Tensor,
                    bt: list[int], seq_len: int, *, kv_head: int, group: int, ctx_start: int,
                    p_begin: int, p_end: int, scale: float, cap: float,
                    slopes: list[float] | None,
                    nw: int = 4) -> tuple[torch.Tensor, list[float], list[float]]:
    """One thread block of decode_fp8_keys_kernel (csrc/decode_fp8_keys.cuh), k_scale = 1.

    What a lane reads from its warp's shared-memory ring is modelled as the direct read of
    `load` (`keys_ring_reads` checks that the ring returns exactly that).

    `k_view` is the fp8 K layout ``[blocks, Hkv, D // 16, block, 16]`` and `v_view`
    ``[blocks, Hkv, D, block]``, as values. Returns ``(out [group, D], max (natural), sum)``.
    """
    head_dim = q.shape[1]
    block = v_view.shape[-1]
    vec, mt = head_dim // 16, head_dim // 16
    vpl = vec // 4
    head0 = kv_head * group
    pos_q = seq_len - 1
    n_tiles = -(-(p_end - p_begin) // 16)
    log2e = 1 / math.log(2)
    plain = slopes is None and cap <= 0
    lazy = 8.0
    m_s, l_s, o_s = [], [], []
    def run_warp(warp: int) -> tuple[list[float], list[float], torch.Tensor]:
        qb: list[list[list[Reg]]] = [[[ZERO, ZERO] for _ in range(vec)] for _ in range(32)]
        for lane in range(32):
            g, t = lane // 4, lane % 4
            qrow = q[head0 + g] if g < group else torch.zeros(head_dim, dtype=q.dtype)
            for v in range(vpl):
                for half in range(2):
                    base = t * vpl * 16 + v * 16 + half * 8
                    h = _vec(qrow[base:base + 8])
                    s = v * 4 + 2 * half
                    qb[lane][s] = [h[0], h[1]]
                    qb[lane][s + 1] = [h[2], h[3]]
        o = [[[0.0] * 4 for _ in range(mt)] for _ in range(32)]
        m = [[NEG, NEG] for _ in range(32)]
        lsum = [[0.0, 0.0] for _ in range(32)]

        def lookup(tile: int) -> int:
            kb = p_begin + tile * 16
            return bt[kb // block] if tile < n_tiles and kb + 16 > ctx_start else -1

        def load(tile: int, phys: int) -> tuple[list[Any], list[Any]]:
            kr = [[[[0.0] * 16, [0.0] * 16] for _ in range(vpl)] for _ in range(32)]
            vr = [[[[0.0] * 4, [0.0] * 4] for _ in range(mt)] for _ in range(32)]
            if phys < 0:
                return kr, vr
            in_blk = (p_begin + tile * 16) % block
            for lane in range(32):
                g, t = lane // 4, lane % 4
                row0 = 4 * (g // 2) + (g & 1)
                for v in range(vpl):
                    for r in range(2):
                        kr[lane][v][r] = k_view[phys, kv_head, t * vpl + v,
                                                in_blk + row0 + 2 * r].tolist()
                for j in range(mt):
                    for r in range(2):
                        vr[lane][j][r] = v_view[phys, kv_head, 16 * j + g + 8 * r,
                                                in_blk + 4 * t:in_blk + 4 * t + 4].tolist()
            return kr, vr

        def compute(tile: int, kr: list[Any], vr: list[Any]) -> None:
            kb = p_begin + tile * 16
            acc = [[[0.0] * 4 for _ in range(32)] for _ in range(2)]
            for s in range(vec):
                a = []
                for lane in range(32):
                    w0 = kr[lane][s // 4][0][4 * (s % 4):4 * (s % 4) + 4]
                    w1 = kr[lane][s // 4][1][4 * (s % 4):4 * (s % 4) + 4]
                    a.append([(w0[0], w0[1]), (w1[0], w1[1]), (w0[2], w0[3]), (w1[2], w1[3])])
                acc[s % 2] = mma_16816(a, [qb[lane][s] for lane in range(32)], acc[s % 2])
            full = kb >= ctx_start and kb + 16 <= p_end
            x = [[[0.0, 0.0], [0.0, 0.0]] for _ in range(32)]  # [lane][head 2t + h][row r]
            for lane in range(32):
                g, t = lane // 4, lane % 4
                row0 = 4 * (g // 2) + (g & 1)
                for r in range(2):
                    key = kb + row0 + 2 * r
                    vis = full or ctx_start <= key < p_end
                    for h in range(2):
                        raw = acc[0][lane][2 * r + h] + acc[1][lane][2 * r + h]
                        slope = (slopes[head0 + 2 * t + h]
                                 if slopes and 2 * t + h < group else 0.0)
                        val = (raw * scale * log2e if plain
                               else log2e * _transform(raw, scale, cap, slope, key, pos_q))
                        x[lane][h][r] = val if vis else NEG
            lmx = [[max(x[lane][h]) for h in range(2)] for lane in range(32)]
            if any(lmx[lane][h] > m[lane][h] + lazy for lane in range(32) for h in range(2)):
                for h in range(2):
                    tmax = [max(lmx[u][h] for u in range(lane % 4, 32, 4)) for lane in range(32)]
                    for lane in range(32):
                        m_new = max(m[lane][h], tmax[lane])
                        alpha = 1.0 if m_new == NEG else _exp2(m[lane][h] - m_new)
                        lsum[lane][h] *= alpha
                        for j in range(mt):
                            o[lane][j][h] *= alpha
                            o[lane][j][2 + h] *= alpha
                        m[lane][h] = m_new
            pr = [[[0.0 if x[lane][h][r] == NEG else _exp2(x[lane][h][r] - m[lane][h])
                    for r in range(2)] for h in range(2)] for lane in range(32)]
            for lane in range(32):
                for h in range(2):
                    assert pr[lane][h][0] <= 2.0**lazy and pr[lane][h][1] <= 2.0**lazy
                    lsum[lane][h] += pr[lane][h][0] + pr[lane][h][1]
            b0 = movmatrix_trans([(pr[lane][0][0], pr[lane][1][0]) for lane in range(32)])
            b1 = movmatrix_trans([(pr[lane][0][1], pr[lane][1][1]) for lane in range(32)])
            bp = [[b0[lane], b1[lane]] for lane in range(32)]
            for j in range(mt):
                a = []
                for lane in range(32):
                    t = lane % 4
                    vis = [full or ctx_start <= kb + 4 * t + i < p_end for i in range(4)]
                    w0 = [val if vis[i] else 0.0 for i, val in enumerate(vr[lane][j][0])]
                    w1 = [val if vis[i] else 0.0 for i, val in enumerate(vr[lane][j][1])]
                    a.append([(w0[0], w0[1]), (w1[0], w1[1]), (w0[2], w0[3]), (w1[2], w1[3])])
                d = mma_16816(a, bp, [o[lane][j] for lane in range(32)])
                for lane in range(32):
                    o[lane][j] = d[lane]

        for tile in range(warp, n_tiles, nw):
            phys = lookup(tile)
            if phys >= 0:  # a tile without a visible key copies nothing and is skipped
                compute(tile, *load(tile, phys))
        wm, wl = [NEG] * 8, [0.0] * 8
        wo = torch.zeros(8, head_dim, dtype=torch.float64)
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for h in range(2):
                col = 2 * t + h
                wm[col] = m[lane][h]
                wl[col] = sum(lsum[u][h] for u in range(t, 32, 4))
                for j in range(mt):
                    wo[col, 16 * j + g] = o[lane][j][h]
                    wo[col, 16 * j + g + 8] = o[lane][j][2 + h]
        return wm, wl, wo

    for warp in range(nw):
        wm, wl, wo = run_warp(warp)
        m_s.append(wm)
        l_s.append(wl)
        o_s.append(wo)
    return _merge_warps(m_s, l_s, o_s, group)


def keys_ring_reads(head_dim: int) -> list[dict[str, list[tuple[int, ...]]]]:
    """What each lane of decode_fp8_keys_kernel's shared-memory ring reads back, as sources.

    A stage is written by the cooperative 16-byte copies (`issue`: lane + 32 i takes K chunk
    (vector, key) to slot ``vector * 16 + (key ^ 2 (vector / VPL))``, V row r to slot
    ``K_CHUNKS + r``) and read per lane as in the kernel. Returns per lane the K sources
    ``(vector, key)`` and V sources ``(row, first key)`` it received, in the order of the
    model's `load` (the direct reads) (``kr[v][r]``, then ``vr[j][r]``), to compare with it.
    """
    vec = head_dim // 16
    vpl = vec // 4
    k_chunks = vec * 16
    slots: dict[int, tuple[str, int, int]] = {}
    for lane in range(32):
        for i in range(k_chunks // 32):
            c = lane + 32 * i
            vv, k = c // 16, c % 16
            slots[vv * 16 + (k ^ (2 * (vv // vpl)))] = ("k", vv, k)
        for i in range(head_dim // 32):
            r = lane + 32 * i
            slots[k_chunks + r] = ("v", r, 0)
    assert len(slots) == k_chunks + head_dim, "two copies land in one slot"
    reads = []
    for lane in range(32):
        g, t = lane // 4, lane % 4
        row0 = 4 * (g // 2) + (g & 1)
        ks, vs = [], []
        for v in range(vpl):
            vv = t * vpl + v
            for r in range(2):
                kind, a, b = slots[vv * 16 + ((row0 + 2 * r) ^ (2 * t))]
                assert kind == "k"
                ks.append((a, b))
        for j in range(head_dim // 16):
            for r in range(2):
                word = (16 * j + g + 8 * r) * 4 + t  # 32-bit word index in the V part
                kind, row, _ = slots[k_chunks + word // 4]
                assert kind == "v"
                vs.append((row, 4 * (word % 4)))
        reads.append({"k": ks, "v": vs})
    return reads


def keys_ring_bank_conflicts(head_dim: int) -> int:
    """Most lanes of one quarter-warp whose 16-byte K reads share a bank group (1 = none)."""
    vec = head_dim // 16
    vpl = vec // 4
    worst = 1
    for v in range(vpl):
        for r in range(2):
            for quarter in range(4):
                groups: dict[int, int] = {}
                for lane in range(8 * quarter, 8 * quarter + 8):
                    g, t = lane // 4, lane % 4
                    row0 = 4 * (g // 2) + (g & 1)
                    slot = (t * vpl + v) * 16 + ((row0 + 2 * r) ^ (2 * t))
                    groups[slot % 8] = groups.get(slot % 8, 0) + 1
                worst = max(worst, *groups.values())
    return worst
