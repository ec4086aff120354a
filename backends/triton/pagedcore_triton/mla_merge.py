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
