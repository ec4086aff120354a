"""The cuda_paged KV-cache layout: one tensor per layer holding a K and a V layout built for
16-byte loads.

One layer's cache is ``[2, num_blocks, num_kv_heads * head_size * block_size]``:

* ``cache[0]`` viewed as ``[num_blocks, num_kv_heads, head_size // x, block_size, x]`` is K,
  where ``x = 16 // element_size`` (8 for fp16/bf16, 4 for fp32): one 16-byte vector holds
  ``x`` consecutive head dims of one key, and the vectors of consecutive keys are adjacent, so
  a warp reading one chunk of a block's keys reads contiguous memory;
* ``cache[1]`` viewed as ``[num_blocks, num_kv_heads, head_size, block_size]`` is V: one
  head dim of a block's keys is contiguous, so the P·V loop reads 16-byte vectors of keys.

Both halves have the same element count per block, which is why one tensor holds them.
Block 0 is the null block and never holds data.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedcore.kv_cache.spec import DTYPE_SIZES

if TYPE_CHECKING:
    import torch

__all__ = [
    "DECODE_THREADS",
    "gather_kv",
    "kv_cache_shape",
    "split_kv_cache",
    "vec_elems",
    "write_kv",
]

#: Threads of one decode thread block (csrc/params.h kDecodeThreads).
DECODE_THREADS = 128


def vec_elems(element_size: int) -> int:
    """``x``: elements of one 16-byte vector (8 for fp16/bf16, 4 for fp32)."""
    if element_size not in (1, 2, 4):
        raise ValueError(f"element size {element_size} bytes is not 1, 2 or 4")
    return 16 // element_size


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype: str
) -> tuple[int, int, int]:
    """``(2, num_blocks, num_kv_heads * head_size * block_size)``; checks the 16-byte rules.

    `cache_dtype` is a dtype name (``"float16"``) or ``"auto"`` (checked as 2-byte, the
    stricter of the model dtypes for the ``x`` divisibility).
    """
    for name, value in (("num_blocks", num_blocks), ("block_size", block_size),
                        ("num_kv_heads", num_kv_heads), ("head_size", head_size)):
        if value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    size = 2 if cache_dtype == "auto" else DTYPE_SIZES.get(cache_dtype)
    if size is None:
        raise ValueError(f"cache dtype {cache_dtype!r} is not one of {', '.join(DTYPE_SIZES)}")
    x = vec_elems(size)
    if head_size % x or block_size % x:
        raise ValueError(
            f"cuda_paged needs head_size ({head_size}) and block_size ({block_size}) to be "
            f"multiples of {x} (one 16-byte vector of {cache_dtype} elements)"
        )
    return (2, num_blocks, num_kv_heads * head_size * block_size)


def split_kv_cache(
    kv_cache: torch.Tensor, *, block_size: int, num_kv_heads: int, head_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of one layer's cache as K and V.

    Parameters
    ----------
    kv_cache:
        ``[2, num_blocks, num_kv_heads * head_size * block_size]``, contiguous.

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        K ``[num_blocks, Hkv, D // x, block_size, x]`` and V ``[num_blocks, Hkv, D, block_size]``,
        views sharing the cache's memory and dtype.
    """
    expected = num_kv_heads * head_size * block_size
    if kv_cache.dim() != 3 or kv_cache.shape[0] != 2 or kv_cache.shape[2] != expected:
        raise ValueError(
            f"kv_cache shape {tuple(kv_cache.shape)} is not (2, num_blocks, {expected}) for "
            f"num_kv_heads={num_kv_heads}, head_size={head_size}, block_size={block_size}; "
            "allocate it with CudaPagedBackend.get_kv_cache_shape"
        )
    x = vec_elems(kv_cache.element_size())
    nb = kv_cache.shape[1]
    k = kv_cache[0].view(nb, num_kv_heads, head_size // x, block_size, x)
    v = kv_cache[1].view(nb, num_kv_heads, head_size, block_size)
    return k, v


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    block_size: int,
) -> None:
    """The cache write in plain torch (the layout's executable definition; CPU tests use it).

    Parameters
    ----------
    key, value:
        ``[T, Hkv, D]`` in the cache dtype.
    kv_cache:
        As `split_kv_cache` takes it.
    slot_mapping:
        ``[T]`` int64; ``-1`` entries are skipped.
    """
    t, hkv, d = key.shape
    k_view, v_view = split_kv_cache(kv_cache, block_size=block_size, num_kv_heads=hkv,
                                    head_size=d)
    x = k_view.shape[-1]
    keep = slot_mapping[:t] >= 0
    slots = slot_mapping[:t][keep]
    blocks, offs = slots // block_size, slots % block_size
    # K: [n, Hkv, D] -> [n, Hkv, D//x, x], placed at [block, :, :, off, :].
    k_view[blocks, :, :, offs, :] = key[keep].reshape(-1, hkv, d // x, x)
    v_view[blocks, :, :, offs] = value[keep]


def gather_kv(
    kv_cache: torch.Tensor,
    block_ids: torch.Tensor,
    seq_len: int,
    *,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read one request's first `seq_len` keys and values back, each ``[seq_len, Hkv, D]``.

    `block_ids` is the request's block-table row (``[>= ceil(seq_len / block_size)]`` int).
    """
    import torch

    k_view, v_view = split_kv_cache(kv_cache, block_size=block_size,
                                    num_kv_heads=num_kv_heads, head_size=head_size)
    pos = torch.arange(seq_len, device=kv_cache.device)
    blocks = block_ids.to(kv_cache.device).long()[pos // block_size]
    offs = pos % block_size
    k = k_view[blocks, :, :, offs, :].reshape(seq_len, num_kv_heads, head_size)
    v = v_view[blocks, :, :, offs]
    return k, v
