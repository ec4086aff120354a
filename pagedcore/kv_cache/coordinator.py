"""Coordinators: drive one single-type manager per KV-cache group and combine prefix hits.

- `NoPrefixCacheCoordinator`: prefix caching off; never finds a hit.
- `UnitaryCoordinator`: one group; its manager's hit is the answer.
- `HybridCoordinator`: several groups (e.g. Gemma-2's sliding-window and full-attention layers).
  A hit must be usable by every group, and groups disagree: full attention needs the whole
  prefix, a sliding window only its last blocks. Fixed-point iteration: start from the longest
  length allowed, let each group shorten it to its own longest usable hit (aligned down to the
  LCM of the block sizes), repeat until no group shortens it. Each step keeps the true answer
  ``L*`` below the current length (a group's longest hit ``<= L`` is ``>= L*`` because ``L*``
  is usable by it), so the fixed point is the longest length usable by all groups.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pagedcore.kv_cache.block_pool import BlockPool, KVCacheBlock
from pagedcore.kv_cache.hashing import BlockHash
from pagedcore.kv_cache.single_type import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
    manager_class_for_spec,
)
from pagedcore.kv_cache.spec import KVCacheConfig

__all__ = [
    "HybridCoordinator",
    "KVCacheCoordinator",
    "NoPrefixCacheCoordinator",
    "UnitaryCoordinator",
    "make_coordinator",
]

#: One block list per KV-cache group.
GroupBlocks = tuple[list[KVCacheBlock], ...]


class KVCacheCoordinator:
    """Fans each manager operation out to the per-group single-type managers."""

    def __init__(self, kv_cache_config: KVCacheConfig, block_pool: BlockPool) -> None:
        self.block_pool = block_pool
        self.managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            manager_class_for_spec(group.spec)(group.spec, block_pool, group_id=i)
            for i, group in enumerate(kv_cache_config.groups)
        )
        self.block_sizes = tuple(m.block_size for m in self.managers)

    @property
    def num_groups(self) -> int:
        return len(self.managers)

    def empty(self) -> GroupBlocks:
        return tuple([] for _ in self.managers)

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: GroupBlocks
    ) -> int:
        return sum(
            m.get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks[i])
            for i, m in enumerate(self.managers)
        )

    def num_blocks_freed_by_skip(self, request_id: str, num_computed_tokens: int) -> int:
        return sum(
            m.num_blocks_freed_by_skip(request_id, num_computed_tokens) for m in self.managers
        )

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for m in self.managers:
            m.remove_skipped_blocks(request_id, num_computed_tokens)

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: GroupBlocks) -> None:
        for i, m in enumerate(self.managers):
            m.save_new_computed_blocks(request_id, new_computed_blocks[i])

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> GroupBlocks:
        return tuple(m.allocate_new_blocks(request_id, num_tokens) for m in self.managers)

    def cache_blocks(
        self, request_id: str, block_hashes: Sequence[Sequence[BlockHash]], num_tokens: int
    ) -> None:
        """``block_hashes[i]``: the request's block hashes at group ``i``'s block size."""
        for i, m in enumerate(self.managers):
            m.cache_blocks(request_id, block_hashes[i], num_tokens)

    def free(self, request_id: str) -> None:
        for m in self.managers:
            m.free(request_id)

    def get_blocks(self, request_id: str) -> GroupBlocks:
        return tuple(m.get_blocks(request_id) for m in self.managers)

    def get_num_common_prefix_blocks(
        self, request_id: str, num_running_requests: int
    ) -> list[int]:
        return [
            m.get_num_common_prefix_blocks(request_id, num_running_requests) for m in self.managers
        ]

    def find_longest_cache_hit(
        self, block_hashes: Sequence[Sequence[BlockHash]], max_length: int
    ) -> tuple[GroupBlocks, int]:
        """Longest prefix of at most ``max_length`` tokens usable by every group.

        Returns the hit blocks per group and the hit length in tokens.
        """
        raise NotImplementedError


class NoPrefixCacheCoordinator(KVCacheCoordinator):
    """Prefix caching disabled: no hits."""

    def find_longest_cache_hit(
        self, block_hashes: Sequence[Sequence[BlockHash]], max_length: int
    ) -> tuple[GroupBlocks, int]:
        return self.empty(), 0


class UnitaryCoordinator(KVCacheCoordinator):
    """A single KV-cache group."""

    def __init__(self, kv_cache_config: KVCacheConfig, block_pool: BlockPool) -> None:
        super().__init__(kv_cache_config, block_pool)
        if self.num_groups != 1:
            raise ValueError(f"UnitaryCoordinator serves one group, got {self.num_groups}")

    def find_longest_cache_hit(
        self, block_hashes: Sequence[Sequence[BlockHash]], max_length: int
    ) -> tuple[GroupBlocks, int]:
        manager = self.managers[0]
        hit = manager.find_longest_cache_hit(block_hashes[0], max_length)
        return (hit,), len(hit) * manager.block_size


class HybridCoordinator(KVCacheCoordinator):
    """Several groups of possibly different attention types and block sizes."""

    def __init__(self, kv_cache_config: KVCacheConfig, block_pool: BlockPool) -> None:
        super().__init__(kv_cache_config, block_pool)
        self.lcm_block_size = math.lcm(*self.block_sizes)
        # Full-attention groups first: their hit is prefix-closed and usually the shortest, so
        # the others start from a tight bound.
        self._search_order = sorted(
            range(self.num_groups),
            key=lambda i: not isinstance(self.managers[i], FullAttentionManager),
        )

    def find_longest_cache_hit(
        self, block_hashes: Sequence[Sequence[BlockHash]], max_length: int
    ) -> tuple[GroupBlocks, int]:
        lcm = self.lcm_block_size
        length = max_length // lcm * lcm
        hits: list[list[KVCacheBlock]] = [[] for _ in self.managers]
        while True:
            shortened = False
            for i in self._search_order:
                manager = self.managers[i]
                hits[i] = manager.find_longest_cache_hit(block_hashes[i], length)
                group_length = len(hits[i]) * manager.block_size // lcm * lcm
                if group_length < length:
                    length = group_length
                    shortened = True
            if not shortened or length == 0:
                break
        if length == 0:
            return self.empty(), 0
        # At the fixed point every group's hit is exactly `length` tokens long.
        return tuple(hits), length


def make_coordinator(
    kv_cache_config: KVCacheConfig, block_pool: BlockPool, *, enable_caching: bool
) -> KVCacheCoordinator:
    """The coordinator for this configuration."""
    if not enable_caching:
        return NoPrefixCacheCoordinator(kv_cache_config, block_pool)
    if len(kv_cache_config.groups) == 1:
        return UnitaryCoordinator(kv_cache_config, block_pool)
    return HybridCoordinator(kv_cache_config, block_pool)
