"""The tensor-core kernels' fragment and index arithmetic, replayed on CPU (`mma_emulation`)
against the reference: NaN-poisoned cache, permuted blocks, GQA, window / ALiBi / soft-cap,
partitions, unroll, chunked prefill over a cached prefix. A wrong permutation, mask or edge
zeroing shows up as a large error or a NaN."""

from __future__ import annotations

import math

import pytest
import torch
from mma_emulation import (
    decode_fp8_keys,
    decode_mma,
    gather_plan,
    keys_ring_bank_conflicts,
    keys_ring_reads,
    prefill_mma,
)
from pagedcore_cuda_paged.layout import kv_cache_shape, split_kv_cache, write_kv
from pagedcore_cuda_paged.plan import decode_span, num_partitions
from pagedcore_cuda_paged.torch_ref import attention_reference


def _paged(seq_len: int, hkv: int, head: int, block: int, seed: int):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    n = math.ceil(seq_len / block)
    num_blocks = n + 4
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1)[:n].tolist()
    k = torch.randn(seq_len, hkv, head, generator=gen).to(torch.bfloat16)
    v = torch.randn(seq_len, hkv, head, generator=gen).to(torch.bfloat16)
    cache = torch.full(kv_cache_shape(num_blocks, block, hkv, head, "auto"), float("nan"),
                       dtype=torch.bfloat16)
    pos = torch.arange(seq_len)
    slots = torch.tensor(ids)[pos // block] * block + pos % block
    write_kv(k, v, cache, slots, block_size=block)
    kv, vv = split_kv_cache(cache, block_size=block, num_kv_heads=hkv, head_size=head)
    return ids, k, v, kv.double(), vv.double(), gen


def _partitions(seq_len: int, block: int, window: int | None,
                part: int | None) -> tuple[int, int, int, int]:
    """``(begin, ctx_start, partition size, partitions)`` of a decode, as the planner has
    them (`part` None: one pass)."""
    begin, ctx_start = decode_span(seq_len, block_size=block, sliding_window=window)
    psize = part or (-(-(seq_len - begin) // block) * block)
    nparts = num_partitions(seq_len, partition_size=psize, block_size=block,
                            sliding_window=window)
    return begin, ctx_start, psize, nparts


def _reduce_partitions(res: list[tuple[torch.Tensor, list[float], list[float]]],
                       out: torch.Tensor, h0: int) -> None:
    """decode_reduce_kernel's merge of one block row's partitions into ``out[h0:]``."""
    for row in range(res[0][0].shape[0]):
        mx = max(r[1][row] for r in res)
        w = [r[2][row] * math.exp(r[1][row] - mx) for r in res]
        out[h0 + row] = sum(wi * r[0][row] for wi, r in zip(w, res, strict=True)) / sum(w)


def _slopes(n: int) -> list[float]:
    return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]


@pytest.mark.parametrize(
    "seq_len,head,block,group,window,alibi,cap,part,unroll",
    [
        (300, 64, 16, 4, None, False, 0.0, None, 1),
        (77, 80, 8, 24, 37, True, 0.0, 32, 2),  # two 16-head chunks, the second of 8
        (130, 64, 32, 16, None, False, 5.0, 64, 1),
        (45, 96, 16, 7, 20, True, 5.0, None, 2),
    ],
)
def test_decode_mma_model(seq_len: int, head: int, block: int, group: int, window: int | None,
                          alibi: bool, cap: float, part: int | None, unroll: int) -> None:
    hkv = 2 if group <= 8 else 1
    hq = hkv * group
    ids, k, v, kv, vv, gen = _paged(seq_len, hkv, head, block, seed=seq_len)
    q = torch.randn(hq, head, generator=gen).to(torch.bfloat16)
    slopes = _slopes(hq) if alibi else None
    ref = attention_reference(q[None], k, v, scale=head**-0.5, sliding_window=window,
                              alibi_slopes=slopes, logits_soft_cap=cap or None)[0]
    begin, ctx_start, psize, nparts = _partitions(seq_len, block, window, part)
    out = torch.zeros(hq, head, dtype=torch.float64)
    for kv_head in range(hkv):
        for chunk in range(-(-group // 16)):
            res = [decode_mma(q.double(), kv, vv, ids, seq_len, kv_head=kv_head, group=group,
                              chunk=chunk, ctx_start=ctx_start, p_begin=begin + i * psize,
                              p_end=min(begin + (i + 1) * psize, seq_len), scale=head**-0.5,
                              cap=cap, slopes=slopes, unroll=unroll) for i in range(nparts)]
            _reduce_partitions(res, out, kv_head * group + chunk * 16)
    err = float((out - ref.double()).abs().max() / ref.abs().max())
    assert err < 1e-6, err


@pytest.mark.parametrize(
    "seq_len,head,block,group,window,alibi,cap,part",
    [
        (300, 128, 16, 4, None, False, 0.0, None),  # Llama-3's GQA 4, one pass
        (77, 64, 32, 7, 37, True, 0.0, 32),  # Qwen2-0.5B's GQA 7, window in a partition
        (130, 64, 16, 8, None, False, 5.0, 64),
        (45, 128, 32, 1, 20, True, 5.0, None),
    ],
)
def test_decode_fp8_keys_model(seq_len: int, head: int, block: int, group: int,
                               window: int | None, alibi: bool, cap: float,
                               part: int | None) -> None:
    # The keys-as-rows fp8 decode on fp8-rounded K/V in the fp8 layout (16 dims a vector),
    # unused slots NaN, queries scaled up so that later tiles exceed the lazily kept max by
    # more than 2^8 (the rescale path) as well as staying under it.
    hkv, hq = 2, 2 * group
    gen = torch.Generator().manual_seed(seq_len)
    n = -(-seq_len // block)
    ids = (torch.randperm(n + 3, generator=gen) + 1)[:n].tolist()
    k = torch.randn(seq_len, hkv, head, generator=gen).to(torch.float8_e4m3fn).double()
    v = torch.randn(seq_len, hkv, head, generator=gen).to(torch.float8_e4m3fn).double()
    k[seq_len // 2:] *= 2.0  # later keys score higher: the running max grows mid-sequence
    kv = torch.full((n + 4, hkv, head // 16, block, 16), float("nan"), dtype=torch.float64)
    vv = torch.full((n + 4, hkv, head, block), float("nan"), dtype=torch.float64)
    for pos in range(seq_len):
        b, off = ids[pos // block], pos % block
        kv[b, :, :, off, :] = k[pos].view(hkv, head // 16, 16)
        vv[b, :, :, off] = v[pos]
    q = (3.0 * torch.randn(hq, head, generator=gen)).to(torch.float16).double()
    slopes = _slopes(hq) if alibi else None
    ref = attention_reference(q[None], k, v, scale=head**-0.5, sliding_window=window,
                              alibi_slopes=slopes, logits_soft_cap=cap or None)[0]
    begin, ctx_start, psize, nparts = _partitions(seq_len, block, window, part)
    out = torch.zeros(hq, head, dtype=torch.float64)
    for kv_head in range(hkv):
        res = [decode_fp8_keys(q, kv, vv, ids, seq_len, kv_head=kv_head, group=group,
                               ctx_start=ctx_start, p_begin=begin + i * psize,
                               p_end=min(begin + (i + 1) * psize, seq_len), scale=head**-0.5,
                               cap=cap, slopes=slopes) for i in range(nparts)]
        _reduce_partitions(res, out, kv_head * group)
    err = float((out - ref.double()).abs().max() / ref.abs().max())
    assert err < 1e-6, err


@pytest.mark.parametrize(
    "ctx,q_len,head,block,window,alibi,cap,mt,warp_mask",
    [
        (70, 100, 64, 16, 0, False, 0.0, 1, False),
        (5, 67, 80, 8, 50, True, 0.0, 1, False),
        (129, 3, 64, 32, 0, False, 5.0, 1, False),
        (40, 150, 64, 16, 90, False, 0.0, 2, False),
        # per-warp masks (MMA_128_FAST_WM): causal diagonals inside 128-row tiles, a
        # window cutting the tile, padding warps (q_len not a multiple of 128), a prefix
        (0, 200, 64, 16, 0, False, 0.0, 2, True),
        (37, 150, 64, 8, 70, False, 0.0, 2, True),
        (64, 90, 64, 32, 0, True, 5.0, 2, True),
        (0, 250, 64, 16, 100, False, 0.0, 2, True),
    ],
)
def test_prefill_mma_model(ctx: int, q_len: int, head: int, block: int, window: int,
                           alibi: bool, cap: float, mt: int, warp_mask: bool) -> None:
    hkv, group = 2, 2
    hq, seq_len = hkv * group, ctx + q_len
    ids, k, v, kv, vv, gen = _paged(seq_len, hkv, head, block, seed=q_len)
    q = torch.randn(q_len, hq, head, generator=gen).to(torch.bfloat16)
    slopes = _slopes(hq) if alibi else None
    ref = attention_reference(q, k, v, scale=head**-0.5, sliding_window=window or None,
                              alibi_slopes=slopes, logits_soft_cap=cap or None)
    head_idx = 3  # KV head 1
    out = torch.cat([
        prefill_mma(q.double(), kv, vv, ids, seq_len=seq_len, q_len=q_len, row0=row0,
                    head=head_idx, kv_head=head_idx // group, scale=head**-0.5, cap=cap,
                    slope=slopes[head_idx] if slopes else 0.0, window=window, mt=mt,
                    warp_mask=warp_mask)
        for row0 in range(0, q_len, 64 * mt)])
    want = ref[:, head_idx].double()
    err = float((out - want).abs().max() / want.abs().max())
    assert err < 1e-6, err


@pytest.mark.parametrize("head", [64, 80, 96, 112, 128])
@pytest.mark.parametrize("block", [8, 16, 32])
@pytest.mark.parametrize("threads,keys", [(128, 64), (256, 64), (128, 32), (256, 32)])
def test_pipelined_gather_reads_what_the_per_vector_gather_reads(
        head: int, block: int, threads: int, keys: int) -> None:
    # Every smem vector of a K / V^T tile: same source (or zero fill) in both gathers, for
    # tiles inside, straddling and past the visible range [kv_lo, kv_hi), for each thread
    # count / tile width the kernel is compiled with (guarded last trips at 80 and 112).
    bt = [(7 * i + 3) % 41 + 1 for i in range(40)]
    for kt, kv_lo, kv_hi in [(0, 0, 500), (64, 70, 121), (128, 0, 130), (192, 150, 250),
                             (256, 0, 257), (32, 40, 50)]:
        want = gather_plan(head, block, bt, kt, kv_lo, kv_hi, pipelined=False, keys=keys)
        got = gather_plan(head, block, bt, kt, kv_lo, kv_hi, pipelined=True,
                          threads=threads, keys=keys)
        assert got == want
        assert len(want) == keys * head // 8 + head * keys // 8


@pytest.mark.parametrize("head", [64, 128])
def test_keys_ring_reads_what_the_direct_load_reads(head: int) -> None:
    # The shared-memory ring of decode_fp8_keys_kernel (STAGES > 0): each lane gets back the
    # K rows rho(g), rho(g) + 2 of its vectors and the V words (rows 16 j + g (+ 8), keys
    # 4t..4t+3) that the model's direct `load` reads, and the swizzle keeps a quarter-warp's
    # 16-byte K reads on distinct bank groups.
    vpl = head // 64
    for lane, got in enumerate(keys_ring_reads(head)):
        g, t = lane // 4, lane % 4
        row0 = 4 * (g // 2) + (g & 1)
        assert got["k"] == [(t * vpl + v, row0 + 2 * r) for v in range(vpl) for r in range(2)]
        assert got["v"] == [(16 * j + g + 8 * r, 4 * t) for j in range(head // 16)
                            for r in range(2)]
    assert keys_ring_bank_conflicts(head) == 1
