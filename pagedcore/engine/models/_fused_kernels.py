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

__all__ = ["rms_norm_kernel", "silu_mul_kernel"]


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
