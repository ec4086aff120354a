"""Helpers for the KV-cache tests: a minimal request and config builders."""

from __future__ import annotations

from collections.abc import Sequence

from pagedcore.kv_cache.spec import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)


class FakeRequest:
    """Satisfies `pagedcore.kv_cache.manager.KVRequest`."""

    def __init__(
        self,
        request_id: str,
        prompt: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = list(prompt)
        self.output: list[int] = []
        self.num_computed_tokens = 0
        self.cache_salt = cache_salt
        self.lora_name = lora_name

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)


def full_spec(block_size: int = 4) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=8, dtype="float16")


def sliding_spec(block_size: int = 4, window: int = 6) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size, num_kv_heads=2, head_size=8, dtype="float16", sliding_window=window
    )


def chunked_spec(block_size: int = 4, chunk: int = 8) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(
        block_size=block_size, num_kv_heads=2, head_size=8, dtype="float16",
        attention_chunk_size=chunk,
    )


def config_for(specs: Sequence[AttentionSpec], num_blocks: int) -> KVCacheConfig:
    """One group (of one layer) per spec."""
    groups = [
        KVCacheGroupSpec(layer_names=(f"model.layers.{i}.self_attn",), spec=spec)
        for i, spec in enumerate(specs)
    ]
    return KVCacheConfig(num_blocks=num_blocks, groups=groups)


def first_needed_block(spec: AttentionSpec, pos: int) -> int:
    """First block a query at ``pos`` reads (written independently of the managers)."""
    if isinstance(spec, SlidingWindowSpec):
        lowest_visible_key = max(0, pos - spec.sliding_window + 1)  # pos - k < W
        return lowest_visible_key // spec.block_size
    if isinstance(spec, ChunkedLocalAttentionSpec):
        chunk_start = pos // spec.attention_chunk_size * spec.attention_chunk_size
        return chunk_start // spec.block_size
    return 0
