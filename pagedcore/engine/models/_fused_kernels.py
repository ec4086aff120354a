"""Triton kernels behind `pagedcore.engine.models.fused_ops` (importing this module imports triton).

Both kernels reproduce transformers' rounding points, so a swapped model computes what the
unswapped one does, in one launch instead of five to seven:

- `rms_norm_kernel`: ``y = w * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` per row, the mean in
  fp32 (LlamaRMSNorm and its copies in Qwen2/Qwen3/Mistral: normalise in fp32, round to the
  input dtype, then multiply by the weight, whose product torch computes in fp32 and rounds
  to the output dtype).
- `silu_mul_kernel`: ``out = silu(gate).to(gate.dtype) * up`` elementwise (the MLP's
  ``act_fn(gate_proj(x)) * up_proj(x)``: ``F.silu`` rounds to its input dtype before the
  multiply).

Set ``TRITON_INTERPRET=1`` before this module is first imported to run them on CPU tensors.
"""
# Triton kernel parameters carry no Python annotations (triton reads them as type hints).
# mypy: disable-error-code="no-untyped-def, untyped-decorator"

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "add_rms_norm_kernel", "rms_norm_kernel", "rotary_kernel", "silu_mul_kernel",
    "silu_mul_rows_kernel",
]


@triton.jit
def rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    x_row_stride,
    out_row_stride,
    n_cols,
    eps,
    BLOCK: tl.constexpr,
):
    """One program per row: ``out[r] = w * round_x(x[r] * rsqrt(mean(x[r]^2) + eps))``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    variance = tl.sum(x * x, axis=0) / n_cols
    normed = x * tl.rsqrt(variance + eps)
    # transformers rounds the normalised row to the input dtype before the weight multiply.
    normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, (normed * w).to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def silu_mul_kernel(gate_ptr, up_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    """``out = round_gate(gate * sigmoid(gate)) * up`` over ``numel`` contiguous elements."""
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    mask = offs < numel
    gate = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    act = gate / (1.0 + tl.exp(-gate))
    # F.silu returns the gate's dtype; the multiply then happens on that rounded value.
    act = act.to(gate_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    x_tok_stride,
    cs_tok_stride,
    num_tokens,
    first_heads,
    second_heads,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
    ROUND: tl.constexpr,
):
    """One program per (token, head): ``x * cos + rotate_half(x) * sin`` of one head.

    Input heads lie `HEAD_DIM` apart in a token row (the q, k and v heads of a fused QKV
    output, or one tensor's heads). Heads below `first_heads` (q) and the next `second_heads`
    (k) are rotated; any heads after them (v) are copied as they are. The three groups go to
    three contiguous outputs ``[T, H_g, D]`` one behind the other in `out_ptr`. With `ROUND`
    each product is rounded to the output dtype before the sum, as torch's separate ops round.
    """
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    num_heads = tl.num_programs(1).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    src = x_ptr + tok * x_tok_stride + head * HEAD_DIM
    x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    rotated = first_heads + second_heads
    if head < rotated:
        cs = tok * cs_tok_stride
        c1 = tl.load(cos_ptr + cs + offs, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + cs + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + cs + offs, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + cs + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        a1 = x1 * c1
        b1 = x2 * s1
        a2 = x2 * c2
        b2 = x1 * s2
        if ROUND:
            a1 = a1.to(dt).to(tl.float32)
            b1 = b1.to(dt).to(tl.float32)
            a2 = a2.to(dt).to(tl.float32)
            b2 = b2.to(dt).to(tl.float32)
        x1 = a1 - b1  # x1 * cos + (-x2) * sin: the same rounding
        x2 = a2 + b2
    in_first = head < first_heads
    start = tl.where(in_first, 0, tl.where(head < rotated, first_heads, rotated))
    width = tl.where(in_first, first_heads,
                     tl.where(head < rotated, second_heads, num_heads - rotated))
    dst = (num_tokens * start + tok * width + head - start) * HEAD_DIM
    tl.store(out_ptr + dst + offs, x1.to(dt), mask=mask)
    tl.store(out_ptr + dst + HALF + offs, x2.to(dt), mask=mask)


@triton.jit
def add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    sum_ptr,
    out_ptr,
    x_row_stride,
    res_row_stride,
    n_cols,
    eps,
    BLOCK: tl.constexpr,
):
    """One program per row: ``s = round(x + res)`` (stored), ``out = rms_norm(s) * w`` (the
    decoder layer's residual add and the next norm, rounded where transformers rounds)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + row * res_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    s = (x + r).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * n_cols + cols, s, mask=mask)
    s32 = s.to(tl.float32)
    variance = tl.sum(s32 * s32, axis=0) / n_cols
    normed = (s32 * tl.rsqrt(variance + eps)).to(sum_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (normed * w).to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def silu_mul_rows_kernel(gu_ptr, out_ptr, n_cols, gu_row_stride, BLOCK: tl.constexpr):
    """``out[r] = round_gate(silu(gu[r, :n])) * gu[r, n:2n]`` over blocks of a row (the
    output of one GEMM over stacked gate and up weights)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    src = gu_ptr + row * gu_row_stride
    gate = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(src + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    act = gate / (1.0 + tl.exp(-gate))
    act = act.to(gu_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)
