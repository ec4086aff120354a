"""Per-group block bookkeeping, one manager class per attention type.

Each manager owns the block lists of one KV-cache group (``request_id -> [KVCacheBlock]``,
position ``i`` of the list holding tokens ``[i * B, (i + 1) * B)``) and knows which of a
request's blocks its layers still read:

- full attention (and MLA) reads every block;
- a sliding window of ``W`` reads tokens ``p - W < k <= p`` for a query at ``p``;
- chunked local attention reads the chunk holding the query.

Blocks no longer read are freed and replaced by the null block, which bounds a sliding-window
request's memory by its window. The same rule decides prefix hits: a hit of ``k`` blocks is
usable when every block the next token reads, ``[first_needed_block(k * B), k)``, is cached.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat
from typing import cast

from pagedcore.kv_cache.block_pool import BlockPool, KVCacheBlock
from pagedcore.kv_cache.hashing import BlockHash
from pagedcore.kv_cache.spec import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    SlidingWindowSpec,
    cdiv,
)

__all__ = [
    "ChunkedLocalManager",
    "FullAttentionManager",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "manager_class_for_spec",
]


class SingleTypeKVCacheManager:
    """Block lists of one KV-cache group; subclasses say which blocks stay readable."""

    def __init__(self, spec: AttentionSpec, block_pool: BlockPool, *, group_id: int) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.block_pool = block_pool
        self.group_id = group_id
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}

    # -- which blocks are read -------------------------------------------------------------------

    def first_needed_block(self, num_computed_tokens: int) -> int:
        """Index of the first block the token at position ``num_computed_tokens`` reads."""
        return 0

    # -- allocation ------------------------------------------------------------------------------

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """Free blocks that allocating slots for ``num_tokens`` tokens in total would consume.

        Counts new blocks plus prefix-hit blocks that currently sit in the free queue (touching
        them takes them out of it).
        """
        existing = len(self.req_to_blocks.get(request_id, ()))
        num_new = max(0, cdiv(num_tokens, self.block_size) - existing - len(new_computed_blocks))
        num_revived = 0
        for b in new_computed_blocks:  # (a plain loop: ~2x a generator's sum)
            if b.ref_cnt == 0 and not b.is_null:
                num_revived += 1
        return num_new + num_revived

    def num_blocks_freed_by_skip(self, request_id: str, num_computed_tokens: int) -> int:
        """Blocks that `remove_skipped_blocks` would return to the free queue."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return 0
        n = min(self.first_needed_block(num_computed_tokens), len(blocks))
        return sum(1 for b in blocks[:n] if not b.is_null and b.ref_cnt == 1)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the blocks no later token reads and put the null block in their place."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        n = min(self.first_needed_block(num_computed_tokens), len(blocks))
        null = self.block_pool.null_block
        removed: list[KVCacheBlock] = []
        # Walk back from the newest skipped block; everything before a null is already null.
        for i in range(n - 1, -1, -1):
            block = blocks[i]
            if block.is_null:
                break
            removed.append(block)
            blocks[i] = null
        self.block_pool.free_blocks(removed)

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> None:
        """Take references on prefix-hit blocks and append them to the request's table."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        if not new_computed_blocks:
            return
        if blocks:
            raise ValueError(
                f"request {request_id!r} already holds {len(blocks)} blocks in group "
                f"{self.group_id}; prefix-hit blocks can only start a request's table"
            )
        self.block_pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        # Hit blocks are cached already (null blocks are skipped by the pool).
        self.num_cached_blocks[request_id] = len(new_computed_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Grow the request's table to hold ``num_tokens`` tokens; return the new blocks."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new = cdiv(num_tokens, self.block_size) - len(blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(
        self, request_id: str, block_hashes: Sequence[BlockHash], num_tokens: int
    ) -> None:
        """Register the request's blocks that are full once ``num_tokens`` tokens are computed."""
        num_full = num_tokens // self.block_size
        start = self.num_cached_blocks.get(request_id, 0)
        if num_full <= start:
            return
        if len(block_hashes) < num_full:
            raise ValueError(
                f"caching {num_full} blocks of request {request_id!r} needs their hashes, "
                f"only {len(block_hashes)} computed"
            )
        blocks = self.req_to_blocks[request_id]
        self.block_pool.cache_full_blocks(
            blocks, block_hashes, start=start, end=num_full, group_id=self.group_id
        )
        self.num_cached_blocks[request_id] = num_full

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first (the tail is evicted before the head)."""
        blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_blocks.pop(request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The request's block list (empty if unknown)."""
        return self.req_to_blocks.get(request_id, [])

    def get_num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> int:
        """Leading blocks of ``request_id`` referenced by all ``num_running_requests``."""
        return 0

    # -- prefix hits -----------------------------------------------------------------------------

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        """Longest usable prefix hit of at most ``max_length`` tokens, as a block list.

        Blocks before `first_needed_block` of the hit are the null block; the others are cached
        blocks of this group. Searched right to left: a hit of ``k`` blocks needs blocks
        ``[first_needed_block(k * B), k)``; a miss at block ``i`` rules out every ``k > i``
        whose needed range covers ``i``, so the next candidate is ``k = i`` and every block is
        looked up at most once.
        """
        bs = self.block_size
        pool = self.block_pool
        gid = self.group_id
        end = min(len(block_hashes), max(0, max_length) // bs)
        while end > 0:
            first = self.first_needed_block(end * bs)
            found: list[KVCacheBlock] = []
            i = end - 1
            while i >= first:
                block = pool.get_cached_block(block_hashes[i], gid)
                if block is None:
                    break
                found.append(block)
                i -= 1
            if i < first:
                found.reverse()
                return [pool.null_block] * first + found
            end = i
        return []


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention (and MLA): every block stays readable; hits are searched left to right."""

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        # `BlockPool.get_cached_block` over every candidate at C speed (a warm hit looks up
        # hundreds of blocks), then cut at the first miss.
        candidates = block_hashes[: max(0, max_length) // self.block_size]
        cached, gid = self.block_pool.cached, self.group_id
        if not candidates or (candidates[0], gid) not in cached:
            return []  # (a cold prompt: no lookup past its first block)
        found = list(map(cached.get, zip(candidates, repeat(gid))))
        if None in found:
            del found[found.index(None):]
        return cast("list[KVCacheBlock]", found)

    def get_num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> int:
        n = 0
        for block in self.req_to_blocks.get(request_id, ()):
            if block.ref_cnt != num_running_requests:
                break
            n += 1
        return n


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding window ``W``: a query at ``p`` reads keys at ``p - W < k <= p``."""

    def __init__(self, spec: AttentionSpec, block_pool: BlockPool, *, group_id: int) -> None:
        if not isinstance(spec, SlidingWindowSpec):
            raise TypeError(f"SlidingWindowManager needs a SlidingWindowSpec, got {spec!r}")
        super().__init__(spec, block_pool, group_id=group_id)
        self.sliding_window = spec.sliding_window

    def first_needed_block(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size


class ChunkedLocalManager(SingleTypeKVCacheManager):
    """Chunked local attention: a query reads only the keys of its own chunk."""

    def __init__(self, spec: AttentionSpec, block_pool: BlockPool, *, group_id: int) -> None:
        if not isinstance(spec, ChunkedLocalAttentionSpec):
            raise TypeError(f"ChunkedLocalManager needs a ChunkedLocalAttentionSpec, got {spec!r}")
        super().__init__(spec, block_pool, group_id=group_id)
        self.chunk = spec.attention_chunk_size

    def first_needed_block(self, num_computed_tokens: int) -> int:
        return (num_computed_tokens // self.chunk * self.chunk) // self.block_size


def manager_class_for_spec(spec: AttentionSpec) -> type[SingleTypeKVCacheManager]:
    """The manager class serving ``spec`` (MLA and plain attention specs use full attention)."""
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return ChunkedLocalManager
    return FullAttentionManager
