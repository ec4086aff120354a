"""The single-tensor K/V layout: shapes, views, the torch cache write, errors."""

from __future__ import annotations

import pytest
import torch
from pagedcore_cuda_paged import CudaPagedBackend
from pagedcore_cuda_paged.layout import (
    gather_kv,
    kv_cache_shape,
    split_kv_cache,
    vec_elems,
    write_kv,
)


@pytest.mark.parametrize("dtype,x", [(torch.float16, 8), (torch.bfloat16, 8), (torch.float32, 4)])
def test_vec_elems_is_16_bytes(dtype: torch.dtype, x: int) -> None:
    assert vec_elems(torch.empty(0, dtype=dtype).element_size()) == x


def test_shape_holds_k_and_v_of_equal_size() -> None:
    shape = CudaPagedBackend.get_kv_cache_shape(10, 16, 4, 128, "auto")
    assert shape == (2, 10, 4 * 128 * 16)
    cache = torch.zeros(shape, dtype=torch.float16)
    k, v = split_kv_cache(cache, block_size=16, num_kv_heads=4, head_size=128)
    assert k.shape == (10, 4, 16, 16, 8)
    assert v.shape == (10, 4, 128, 16)
    assert k.data_ptr() == cache.data_ptr()
    assert v.data_ptr() == cache[1].data_ptr()


def test_k_element_address_matches_kernel_formula() -> None:
    # csrc/cache_write.cu: ((blk * Hkv + h) * (D / x) + d / x) * B + off) * x + d % x
    nb, b, hkv, d = 3, 8, 2, 64
    cache = torch.zeros(kv_cache_shape(nb, b, hkv, d, "float32"), dtype=torch.float32)
    x = 4
    key = torch.zeros(1, hkv, d)
    blk, off, h, dim = 2, 5, 1, 37
    key[0, h, dim] = 1.0
    write_kv(key, key.clone(), cache, torch.tensor([blk * b + off]), block_size=b)
    flat_k = cache[0].flatten()
    idx = (((blk * hkv + h) * (d // x) + dim // x) * b + off) * x + dim % x
    assert flat_k.nonzero().flatten().tolist() == [idx]
    flat_v = cache[1].flatten()
    assert flat_v.nonzero().flatten().tolist() == [((blk * hkv + h) * d + dim) * b + off]


def test_write_skips_padding_and_gather_round_trips() -> None:
    gen = torch.Generator().manual_seed(0)
    nb, b, hkv, d = 6, 16, 2, 80
    cache = torch.full(kv_cache_shape(nb, b, hkv, d, "bfloat16"), float("nan"),
                       dtype=torch.bfloat16)
    seq = 40
    table = torch.tensor([4, 1, 5], dtype=torch.int32)
    key = torch.randn(seq + 2, hkv, d, generator=gen).to(torch.bfloat16)
    value = torch.randn(seq + 2, hkv, d, generator=gen).to(torch.bfloat16)
    pos = torch.arange(seq)
    slots = torch.cat([table.long()[pos // b] * b + pos % b, torch.tensor([-1, -1])])
    write_kv(key, value, cache, slots, block_size=b)
    k, v = gather_kv(cache, table, seq, block_size=b, num_kv_heads=hkv, head_size=d)
    assert torch.equal(k, key[:seq]) and torch.equal(v, value[:seq])
    # Nothing else was touched: blocks 0, 2, 3 and the tail of block 5 stay NaN.
    k_view, v_view = split_kv_cache(cache, block_size=b, num_kv_heads=hkv, head_size=d)
    for blk in (0, 2, 3):
        assert torch.isnan(k_view[blk].float()).all() and torch.isnan(v_view[blk].float()).all()
    assert torch.isnan(v_view[5, :, :, seq - 2 * b:].float()).all()


@pytest.mark.parametrize(
    "args,match",
    [
        ((4, 16, 2, 100, "float16"), "multiples of 8"),
        ((4, 12, 2, 128, "float16"), "multiples of 8"),
        ((0, 16, 2, 128, "float16"), "num_blocks"),
        ((4, 16, 2, 128, "int8"), "cache dtype"),
    ],
)
def test_bad_shapes_are_clear_errors(args: tuple[int, int, int, int, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        kv_cache_shape(*args)


def test_split_rejects_foreign_shape() -> None:
    with pytest.raises(ValueError, match="get_kv_cache_shape"):
        split_kv_cache(torch.zeros(2, 4, 100), block_size=16, num_kv_heads=2, head_size=64)
