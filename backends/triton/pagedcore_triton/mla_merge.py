# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""The split-KV merge kernel of the Triton MLA decode (`pagedcore_triton.mla_kernels`).

The decode kernel's split programs write fp32 partials ``(acc / sum, max, sum)``; this kernel
combines them with a log-sum-exp. (Variants with ``fused_fanin`` merge inside the decode
kernel instead and launch no merge.)
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["mla_merge_kernel"]


@triton.jit(do_not_specialize=["num_splits"])
def mla_merge_kernel(
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    num_heads,
    num_splits,
    stride_ot,
    stride_oh,
    LATENT: tl.constexpr,
    LATENT_PAD: tl.constexpr,
    COLS: tl.constexpr,
    CHUNK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Grid ``(tokens, H, LATENT_PAD // COLS)``: combine the split partials of one token and
    head (log-sum-exp) for ``COLS`` latent columns (several programs per head, so that a few
    long requests still give enough programs).

    The split count is a runtime value (no recompile per count): partials are read ``CHUNK``
    splits at a time (maxima, sums and accumulators of a chunk in one round trip) and combined
    with a running maximum. With `USE_PDL` (launched with programmatic dependent launch) the
    programs start during the decode kernel's tail and wait for its partials here.
    """
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    tok = tl.program_id(0)
    head = tl.program_id(1)
    col0 = tl.program_id(2) * COLS
    base = (tok.to(tl.int64) * num_heads + head) * num_splits
    offs_s = tl.arange(0, CHUNK)
    offs_l = col0 + tl.arange(0, COLS)
    m_run = tl.full([], float("-inf"), dtype=tl.float32)
    den = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([COLS], dtype=tl.float32)
    for s0 in range(0, num_splits, CHUNK):
        idx = base + s0 + offs_s
        valid = s0 + offs_s < num_splits
        m = tl.load(part_ml_ptr + idx * 2, mask=valid, other=float("-inf"))
        lsum = tl.load(part_ml_ptr + idx * 2 + 1, mask=valid, other=0.0)
        part = tl.load(part_acc_ptr + idx[:, None] * LATENT_PAD + offs_l[None, :],
                       mask=valid[:, None], other=0.0).to(tl.float32)
        # Split 0 is never empty, so m_new is finite from the first chunk on; empty splits
        # carry m = -inf and weigh exp2(-inf) = 0, as does the initial running maximum.
        m_new = tl.maximum(m_run, tl.max(m, axis=0))
        w = tl.exp2(m - m_new)
        rescale = tl.exp2(m_run - m_new)
        acc = acc * rescale + tl.sum(part * (w * lsum)[:, None], axis=0)
        den = den * rescale + tl.sum(lsum * w, axis=0)
        m_run = m_new
    tl.store(out_ptr + tok.to(tl.int64) * stride_ot + head * stride_oh + offs_l,
             (acc / den).to(out_ptr.dtype.element_ty), mask=offs_l < LATENT)


@triton.jit
def mla_merge_slice(out_ptr, part_acc_ptr, part_ml_ptr, tok, heads, head_mask, slice_idx,
                    num_heads, num_splits, stride_ot, stride_oh, LATENT: tl.constexpr,
                    LATENT_PAD: tl.constexpr, NSPLIT: tl.constexpr):
    """Merge latent columns ``[slice_idx * W, (slice_idx + 1) * W)`` (``W = LATENT_PAD //
    NSPLIT``) of one token's `heads` from its `num_splits` (<= `NSPLIT`) partials, which are
    read from L2 (``.cg``: written by other programs of this launch), into the output.

    The decode kernel's token merge (``TOKEN_MERGE``): split program ``j`` of a token merges
    slice ``j``, once every split of the token has written its partial."""
    W: tl.constexpr = LATENT_PAD // NSPLIT
    sp = tl.arange(0, NSPLIT)
    rows = (tok.to(tl.int64) * num_heads + heads)[None, :] * num_splits + sp[:, None]
    ok = (sp < num_splits)[:, None] & head_mask[None, :]
    m = tl.load(part_ml_ptr + rows * 2, mask=ok, other=float("-inf"), cache_modifier=".cg")
    lsum = tl.load(part_ml_ptr + rows * 2 + 1, mask=ok, other=0.0, cache_modifier=".cg")
    m_max = tl.max(m, axis=0)
    # Empty splits (and masked heads) carry m = -inf and weigh 0.
    w = tl.where(m > float("-inf"), tl.exp2(m - m_max[None, :]), 0.0) * lsum
    den = tl.maximum(tl.sum(w, axis=0), 1e-30)
    cols = slice_idx * W + tl.arange(0, W)
    part = tl.load(part_acc_ptr + rows[:, :, None] * LATENT_PAD + cols[None, None, :],
                   mask=ok[:, :, None], other=0.0, cache_modifier=".cg").to(tl.float32)
    merged = tl.sum(part * w[:, :, None], axis=0) / den[:, None]
    dst = out_ptr + (tok.to(tl.int64) * stride_ot + heads * stride_oh)[:, None] + cols[None, :]
    tl.store(dst, merged.to(out_ptr.dtype.element_ty),
             mask=head_mask[:, None] & (cols < LATENT)[None, :])


@triton.jit
def mla_token_merge(out_ptr, part_acc_ptr, part_ml_ptr, ctr, tok, heads, head_mask, split,
                    num_heads, num_splits, stride_ot, stride_oh, LATENT: tl.constexpr,
                    LATENT_PAD: tl.constexpr, NSPLIT: tl.constexpr, SEQUENTIAL: tl.constexpr):
    """The decode kernel's token merge, after this program's partial is stored: count this
    split in on the (token, head block)'s pair of int32 counters ``ctr[0:2]`` (zero between
    launches), wait until all `num_splits` splits are in, merge slice `split` of the output
    (`mla_merge_slice`), then count out; the last one out resets both counters to 0.

    Every split program of a token must be resident at once (the caller checks that the
    grid fits in one wave), since each waits for the others. With `SEQUENTIAL` (the
    interpreter, which runs the programs one after another) nobody waits: the last arrival
    merges every slice."""
    tl.debug_barrier()  # every thread's partial stores before the (one-thread) release
    if SEQUENTIAL:
        if tl.atomic_add(ctr, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
            for j in range(0, num_splits):
                mla_merge_slice(out_ptr, part_acc_ptr, part_ml_ptr, tok, heads, head_mask, j,
                                num_heads, num_splits, stride_ot, stride_oh, LATENT,
                                LATENT_PAD, NSPLIT)
            tl.store(ctr, 0)
    else:
        tl.atomic_add(ctr, 1, sem="release", scope="gpu")
        # Poll with plain loads from L2 (atomics on one address from every split of the
        # token queue up), then one acquiring atomic before reading the others' partials.
        while tl.load(ctr, volatile=True) < num_splits:
            pass
        tl.atomic_add(ctr, 0, sem="acquire", scope="gpu")
        mla_merge_slice(out_ptr, part_acc_ptr, part_ml_ptr, tok, heads, head_mask, split,
                        num_heads, num_splits, stride_ot, stride_oh, LATENT, LATENT_PAD,
                        NSPLIT)
        tl.debug_barrier()  # every thread's reads before counting out
        if tl.atomic_add(ctr + 1, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
            tl.store(ctr, 0)
            tl.store(ctr + 1, 0)
