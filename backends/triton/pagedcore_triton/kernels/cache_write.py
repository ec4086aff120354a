# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Cache write: scatter one step's K/V into the paged cache through ``slot_mapping``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedcore_triton._env import interpreting

__all__ = ["write_kv_cache"]


@triton.jit
def _cache_write_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANT_MAX: tl.constexpr = None,
):
    """One program per token: all KV heads of its K and V row.

    With ``QUANT_MAX`` (an fp8 cache) the rows are stored as ``clamp(x / scale, -QUANT_MAX,
    QUANT_MAX)`` rounded to the cache's fp8 dtype, with the ``[1]`` float32 scales at
    `k_scale_ptr` / `v_scale_ptr`."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_PAD)
    mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_SIZE)[None, :]
    k = tl.load(key_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    if QUANT_MAX is not None:
        k = tl.clamp(k.to(tl.float32) / tl.load(k_scale_ptr), -QUANT_MAX, QUANT_MAX)
        v = tl.clamp(v.to(tl.float32) / tl.load(v_scale_ptr), -QUANT_MAX, QUANT_MAX)
    dst = block * stride_cb + offset * stride_cs + h[:, None] * stride_ch + d[None, :]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Scatter ``key``/``value`` rows into ``kv_cache`` at ``slot_mapping`` (``-1`` skipped).

    Parameters
    ----------
    key, value:
        ``[T, Hkv, D]``, last dimension contiguous, in the cache dtype (or castable to it).
    kv_cache:
        ``[2, num_blocks, block_size, Hkv, D]`` contiguous; index 0 holds K, 1 holds V.
    slot_mapping:
        ``[>= T]`` int64; ``slot = block_id * block_size + offset``; ``-1`` marks padding.
    kv_scales:
        ``(k_scale, v_scale)``, ``[1]`` float32 each, for an fp8 `kv_cache` (required then):
        rows are quantized in the kernel (`pagedcore.attention.kv_quant`).

    Under Triton's interpreter the fp32 -> fp8 conversion rounds wrongly (125.0 becomes 64 in
    e4m3 with triton 3.9), so there the rows are quantized by torch first and the kernel
    scatters their bytes; on a GPU the kernel quantizes.
    """
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, _, block_size, num_kv_heads, head_size = kv_cache.shape
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    quant_max = None
    k_scale = v_scale = slot_mapping
    if kv_cache.dtype.itemsize == 1:
        if kv_scales is None:
            raise ValueError("an fp8 kv_cache needs kv_scales=(k_scale, v_scale)")
        k_scale, v_scale = kv_scales
        if interpreting():
            from pagedcore.attention.kv_quant import quantize_fp8

            key = quantize_fp8(key, k_scale, kv_cache.dtype).view(torch.uint8)
            value = quantize_fp8(value, v_scale, kv_cache.dtype).view(torch.uint8)
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        else:
            quant_max = float(torch.finfo(kv_cache.dtype).max)
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    _cache_write_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale,
        v_scale,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_size),
        BLOCK_SIZE=block_size,
        QUANT_MAX=quant_max,
        num_warps=4,
    )
