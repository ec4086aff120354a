# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Cache write: scatter one step's K/V into the paged cache through ``slot_mapping``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["write_kv_cache"]


@triton.jit
def _cache_write_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
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
):
    """One program per token: all KV heads of its K and V row."""
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
    dst = block * stride_cb + offset * stride_cs + h[:, None] * stride_ch + d[None, :]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
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
    """
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, _, block_size, num_kv_heads, head_size = kv_cache.shape
    k_cache, v_cache = kv_cache[0], kv_cache[1]
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
        num_warps=4,
    )
