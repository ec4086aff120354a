"""KV-cache spec validation and sizes."""

from __future__ import annotations

import pytest

from pagedcore.kv_cache.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    cdiv,
)


def test_full_attention_page_size_counts_k_and_v() -> None:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")
    assert spec.page_size_bytes == 2 * 16 * 8 * 128 * 2
    # 1000 tokens need 63 blocks of 16.
    assert spec.max_memory_usage_bytes(1000, 2048) == 63 * spec.page_size_bytes


def test_torch_dtype_is_accepted_and_stored_by_name() -> None:
    torch = pytest.importorskip("torch")
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float16)
    assert spec.dtype == "float16"
    assert spec.element_size == 2


@pytest.mark.parametrize("field", ["block_size", "num_kv_heads", "head_size"])
@pytest.mark.parametrize("bad", [0, -4])
def test_non_positive_sizes_name_the_field(field: str, bad: int) -> None:
    kwargs = {"block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype": "float16"}
    kwargs[field] = bad
    with pytest.raises(ValueError, match=field):
        FullAttentionSpec(**kwargs)  # type: ignore[arg-type]


def test_unknown_dtype_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="bfloat16"):
        FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="int3")


def test_sliding_window_memory_is_bounded_by_the_window() -> None:
    spec = SlidingWindowSpec(
        block_size=16, num_kv_heads=4, head_size=64, dtype="float16", sliding_window=256
    )
    bound = spec.max_memory_usage_bytes(max_model_len=32768, max_num_batched_tokens=512)
    assert bound == (cdiv(256 - 1 + 512, 16) + 1) * spec.page_size_bytes
    full = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype="float16")
    assert bound < full.max_memory_usage_bytes(32768, 512)
    # A short model length caps it.
    assert spec.max_memory_usage_bytes(64, 512) == (cdiv(64, 16) + 1) * spec.page_size_bytes


def test_chunked_local_memory() -> None:
    spec = ChunkedLocalAttentionSpec(
        block_size=32, num_kv_heads=1, head_size=64, dtype="float32", attention_chunk_size=128
    )
    assert spec.max_memory_usage_bytes(10_000, 64) == (cdiv(192, 32) + 1) * spec.page_size_bytes


def test_mla_stores_one_latent_head_without_kv_doubling() -> None:
    spec = MLAAttentionSpec(block_size=64, kv_lora_rank=512, rope_head_dim=64, dtype="bfloat16")
    assert spec.head_size == 576
    assert spec.num_kv_heads == 1
    assert spec.page_size_bytes == 64 * 576 * 2
    with pytest.raises(ValueError, match="kv_lora_rank"):
        MLAAttentionSpec(block_size=64, kv_lora_rank=0, rope_head_dim=64, dtype="bfloat16")
    with pytest.raises(ValueError, match="one latent head"):
        MLAAttentionSpec(
            block_size=64, kv_lora_rank=512, rope_head_dim=64, dtype="bfloat16", num_kv_heads=2
        )


def test_specs_are_frozen_and_hashable() -> None:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")
    with pytest.raises(AttributeError):
        spec.block_size = 32  # type: ignore[misc]
    same = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")
    assert {spec, same} == {spec}


def test_group_needs_layers() -> None:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")
    with pytest.raises(ValueError, match="at least one layer"):
        KVCacheGroupSpec(layer_names=[], spec=spec)
