# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Split-KV merge and the flat layout of captured mixed steps (shared with the attention kernel).

`merge_segments_kernel` combines the partial ``(acc, max, sum)`` triples that the segments of
`paged_attention_kernel` wrote; `_flat_layout` is how both kernels of a flat launch read the
step's layout from ``query_start_loc`` (see ``LaunchPart.flat_programs``).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["merge_segments_kernel"]


@triton.jit
def _flat_layout(
    qsl_ptr,
    num_reqs,
    num_programs,
    BLOCK_Q: tl.constexpr,
    MAX_SEGMENTS: tl.constexpr,
    REQ_PAD: tl.constexpr,
):
    """The step's layout on a flat grid of `num_programs` per head, from one vector load.

    Returns ``(idx, starts, first, tokens, q_blocks, segments)``: ``[REQ_PAD]`` lanes with
    ``qsl[idx]`` and each request's first q-block (lanes past `num_reqs` are junk), the
    real query tokens, the q-blocks in use (they end at the first of the trailing empty
    requests) and ``segments``, the largest power of two at
    most ``MAX_SEGMENTS`` with ``q_blocks * segments <= num_programs``. ``REQ_PAD >
    num_reqs``: every lane is read at once instead of a chain of dependent loads (a
    binary search), which is what an empty program's time went to.

    Compact numbering: request ``i`` starts at q-block ``qsl[i] // BLOCK_Q - qsl[0] // BLOCK_Q
    + min(i, qsl[i] - qsl[0])`` (`_find_request` adds ``i``). The extra term still bounds the
    blocks the requests before ``i`` need beyond their tokens (each non-empty one adds a token
    as well as a request), so ranges never overlap, and a ``T``-token step uses at most
    ``cdiv(T, BLOCK_Q) + min(num_reqs, T)`` q-blocks however many request slots it has.
    """
    idx = tl.arange(0, REQ_PAD)
    starts = tl.load(qsl_ptr + idx, mask=idx <= num_reqs, other=0)
    base = tl.load(qsl_ptr)  # independent of the vector load: no reduction needed
    last = tl.load(qsl_ptr + num_reqs)
    # Requests up to the last non-empty one (qsl is non-decreasing; qsl[num_reqs] == last).
    used_reqs = tl.sum(((idx <= num_reqs) & (starts < last)).to(tl.int32), 0)
    tokens = last - base
    first = starts // BLOCK_Q - base // BLOCK_Q + tl.minimum(idx, starts - base)
    q_blocks = last // BLOCK_Q - base // BLOCK_Q + tl.minimum(used_reqs, tokens)
    segments: tl.int32 = 1
    while (segments * 2 <= MAX_SEGMENTS) & (q_blocks * segments * 2 <= num_programs):
        segments *= 2
    return idx, starts, first, tokens, q_blocks, segments


@triton.jit
def merge_segments_kernel(
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    token_base,
    stride_ot,
    stride_oh,
    qsl_ptr,
    num_reqs,
    flat_programs,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    BLOCK_Q: tl.constexpr = 1,
    FLAT: tl.constexpr = False,
    REQ_PAD: tl.constexpr = 1,
):
    """Grid ``(Tp, Hq)``: combine the segments' partial ``(acc, max, sum)`` of one row.

    With ``FLAT`` (`qsl_ptr`, `num_reqs`, `flat_programs`, ``BLOCK_Q`` and ``REQ_PAD`` of the
    attention launch), rows past the step's real tokens and steps the attention left unsplit
    return at once, and only the step's segments are read, each only when it saw a key (max > -inf).
    """
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    s = tl.arange(0, NUM_SEGMENTS)
    d = tl.arange(0, HEAD_PAD)
    prow = (tok * num_heads + head) * NUM_SEGMENTS + s
    if FLAT:
        _, _, _, tokens, _, n_seg = _flat_layout(
            qsl_ptr, num_reqs, flat_programs, BLOCK_Q, NUM_SEGMENTS, REQ_PAD
        )
        if (tok >= tokens) | (n_seg == 1):
            return
        m = tl.load(part_ml_ptr + prow * 2, mask=s < n_seg, other=float("-inf"))
        seen = m > float("-inf")
        lse = tl.load(part_ml_ptr + prow * 2 + 1, mask=seen, other=0.0)
        acc = tl.load(part_acc_ptr + prow[:, None] * HEAD_PAD + d[None, :], mask=seen[:, None],
                      other=0.0)
        m_max = tl.max(m, 0)
        m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
        w = tl.exp2(m - m_safe)  # empty segments (m = -inf) weigh 0
        total = tl.sum(w * lse, 0)
    else:  # the classic split-KV merge, in the order its timings were measured with
        m = tl.load(part_ml_ptr + prow * 2)
        lse = tl.load(part_ml_ptr + prow * 2 + 1)
        m_max = tl.max(m, 0)
        m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
        w = tl.exp2(m - m_safe)  # empty segments (m = -inf) weigh 0
        total = tl.sum(w * lse, 0)
        acc = tl.load(part_acc_ptr + prow[:, None] * HEAD_PAD + d[None, :])
    out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    row = (tok + token_base) * stride_ot + head * stride_oh
    tl.store(out_ptr + row + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_SIZE)
