"""`KVCacheManager`: the facade the scheduler uses to find prefix hits and hand out blocks.

Protocol per scheduling step, for a waiting request::

    blocks, num_hit = manager.get_computed_blocks(request)        # no ref count changes
    new = manager.allocate_slots(request, num_new_tokens,
                                 num_new_computed_tokens=num_hit,
                                 new_computed_blocks=blocks)       # None: no room, nothing changed
    ...                                                            # later, for a running request
    new = manager.allocate_slots(request, num_new_tokens)
    manager.free(request)                                          # finished or preempted
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, final, runtime_checkable

import attrs

from pagedcore.kv_cache.block_pool import BlockPool, KVCacheBlock
from pagedcore.kv_cache.coordinator import KVCacheCoordinator, make_coordinator
from pagedcore.kv_cache.hashing import (
    BlockHash,
    BlockHasher,
    make_hash_function,
    root_hash,
)
from pagedcore.kv_cache.spec import KVCacheConfig, cdiv

__all__ = ["KVCacheBlocks", "KVCacheManager", "KVRequest", "PrefixCacheStats"]


@runtime_checkable
class KVRequest(Protocol):
    """What the KV-cache manager reads from a request (the engine's Request satisfies it).

    ``mm_spans`` (a sequence of `pagedcore.kv_cache.hashing.MultiModalSpan`) is read too when
    present, so multimodal content enters the block hashes.
    """

    request_id: str
    num_computed_tokens: int
    cache_salt: str | None
    lora_name: str | None

    @property
    def all_token_ids(self) -> Sequence[int]:
        """Prompt tokens followed by the tokens generated so far."""
        ...

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        ...


@final
@attrs.frozen
class KVCacheBlocks:
    """Blocks of one request (or one allocation), one list per KV-cache group."""

    blocks: tuple[list[KVCacheBlock], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        """Block ids per group."""
        return tuple([b.block_id for b in group] for group in self.blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of blocks of the first group not registered in the prefix cache."""
        return [b.block_id for b in self.blocks[0] if b.block_hash is None and not b.is_null]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(a + b for a, b in zip(self.blocks, other.blocks, strict=True)))

    @property
    def num_blocks(self) -> int:
        """Blocks over all groups."""
        return sum(len(group) for group in self.blocks)


@attrs.frozen(kw_only=True)
class PrefixCacheStats:
    """Prefix-cache counters since construction (or the last `reset_prefix_cache_stats`).

    ``queries`` and ``hits`` are in tokens; ``requests`` counts lookups.
    """

    requests: int
    queries: int
    hits: int
    evictions: int

    @property
    def hit_rate(self) -> float:
        """``hits / queries`` (0.0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0


@final
class KVCacheManager:
    """Hands out KV-cache blocks to requests and shares full blocks through prefix caching.

    Parameters
    ----------
    kv_cache_config : KVCacheConfig
        Block count and KV-cache groups (see `pagedcore.kv_cache.config.make_kv_cache_config`).
    max_model_len : int
        Longest sequence (prompt + output) a request may reach.
    enable_caching : bool
        Share full blocks between requests with the same prefix.
    hash_algo : str
        ``"sha256"`` (default) or ``"xxhash"`` (faster, not collision resistant).
    hash_seed : bytes | int | None
        Seed of the hash chain; None draws a random one per process.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        *,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
        hash_seed: bytes | int | None = None,
    ) -> None:
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(kv_cache_config.num_blocks, enable_caching=enable_caching)
        self.coordinator: KVCacheCoordinator = make_coordinator(
            kv_cache_config, self.block_pool, enable_caching=enable_caching
        )
        hash_fn = make_hash_function(hash_algo)
        root = root_hash(hash_fn, hash_seed)
        # One hasher per distinct block size; groups sharing a block size share hashes.
        self._hashers = {bs: BlockHasher(bs, hash_fn, root) for bs in self.coordinator.block_sizes}
        self._requests = 0
        self._queries = 0
        self._hits = 0
        self._evictions_at_reset = 0

    # -- lookups ---------------------------------------------------------------------------------

    def _block_hashes(self, request: KVRequest) -> list[list[BlockHash]]:
        rid = request.request_id
        by_size = {bs: h.hashes(rid, request) for bs, h in self._hashers.items()}
        return [by_size[bs] for bs in self.coordinator.block_sizes]

    def get_computed_blocks(
        self, request: KVRequest, *, use_cache: bool = True
    ) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of ``request``, in full blocks.

        ``use_cache=False``: no hit (the request computes every token, e.g. to return the
        log-probabilities of its prompt); its blocks still enter the cache as they fill.

        Never covers the request's last known token, so a full hit still computes one token
        (and produces logits). No reference count changes here: pass the result to
        `allocate_slots` in the same scheduling step.

        Returns
        -------
        blocks : KVCacheBlocks
            Hit blocks per group (null blocks where a group no longer reads).
        num_computed_tokens : int
            Tokens covered by the hit (a multiple of the block size).
        """
        if not (self.enable_caching and use_cache):
            return KVCacheBlocks(self.coordinator.empty()), 0
        num_tokens = len(request.all_token_ids)
        blocks, num_hit = self.coordinator.find_longest_cache_hit(
            self._block_hashes(request), max(0, num_tokens - 1)
        )
        self._requests += 1
        self._queries += num_tokens
        self._hits += num_hit
        return KVCacheBlocks(blocks), num_hit

    def allocate_slots(
        self,
        request: KVRequest,
        num_new_tokens: int,
        *,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Make room for ``num_new_tokens`` more tokens of ``request``; all or nothing.

        Parameters
        ----------
        request : KVRequest
            ``num_computed_tokens`` counts tokens already in the cache, excluding this step's
            prefix hit.
        num_new_tokens : int
            Tokens to compute this step.
        num_new_computed_tokens : int
            Tokens covered by ``new_computed_blocks`` (from `get_computed_blocks`).
        new_computed_blocks : KVCacheBlocks | None
            Prefix-hit blocks from `get_computed_blocks` (only for a request holding no blocks).
        num_lookahead_tokens : int
            Extra slots to reserve (speculative decoding); they are not cached.

        Returns
        -------
        KVCacheBlocks | None
            The newly allocated blocks per group, or None when the free blocks do not suffice;
            then no reference count or table has changed.
        """
        if num_new_tokens < 0 or num_new_computed_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(
                f"token counts must be >= 0, got num_new_tokens={num_new_tokens}, "
                f"num_new_computed_tokens={num_new_computed_tokens}, "
                f"num_lookahead_tokens={num_lookahead_tokens}"
            )
        rid = request.request_id
        coordinator = self.coordinator
        hit = new_computed_blocks.blocks if new_computed_blocks is not None else coordinator.empty()
        if any(hit) and any(coordinator.get_blocks(rid)):
            raise ValueError(
                f"request {rid!r} already holds blocks; pass new_computed_blocks only on the "
                "first allocate_slots after get_computed_blocks (or after free)"
            )
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_slots = min(num_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)

        num_needed = coordinator.get_num_blocks_to_allocate(rid, num_slots, hit)
        num_available = self.block_pool.num_free_blocks + coordinator.num_blocks_freed_by_skip(
            rid, request.num_computed_tokens
        )
        if num_needed > num_available:
            return None

        coordinator.remove_skipped_blocks(rid, request.num_computed_tokens)
        if new_computed_blocks is not None:
            coordinator.save_new_computed_blocks(rid, hit)
        new_blocks = coordinator.allocate_new_blocks(rid, num_slots)
        if self.enable_caching:
            num_to_cache = min(num_computed + num_new_tokens, len(request.all_token_ids))
            coordinator.cache_blocks(rid, self._block_hashes(request), num_to_cache)
        return KVCacheBlocks(new_blocks)

    def free(self, request: KVRequest) -> None:
        """Release every block of ``request`` (tail first) and its cached hashes."""
        rid = request.request_id
        self.coordinator.free(rid)
        for hasher in self._hashers.values():
            hasher.forget(rid)

    def uncache_unwritten_blocks(self, request_id: str, num_valid_tokens: int) -> int:
        """Drop the prefix-cache entries of ``request_id``'s blocks past its first
        ``num_valid_tokens`` tokens.

        `allocate_slots` registers blocks as cached before the step that fills them runs; when
        that step fails their contents were never written, so no later request may hit them.
        Call before `free`, or when a step computes fewer tokens than were allocated (the
        request keeps its blocks; later allocations register them again once written).
        Returns the number of blocks uncached.
        """
        dropped = 0
        groups = self.coordinator.get_blocks(request_id)
        for size, blocks in zip(self.coordinator.block_sizes, groups, strict=True):
            for block in blocks[num_valid_tokens // size :]:
                if not block.is_null and block.block_hash is not None:
                    self.block_pool._uncache(block)
                    dropped += 1
        for manager in self.coordinator.managers:
            cached = manager.num_cached_blocks
            if request_id in cached:
                cached[request_id] = min(cached[request_id], num_valid_tokens // manager.block_size)
        return dropped

    def shares_blocks_from(self, request_id: str, num_tokens: int) -> bool:
        """Whether a block of ``request_id`` holding a token at or past its first
        ``num_tokens`` is also held by another request.

        Such a block was registered in the prefix cache when this step allocated it and
        another request admitted in the same step took a hit on it: its slots from
        ``num_tokens`` on must then be written in this step, so the chunk writing them may not
        be shortened (`pagedcore.engine.scheduling.bucket_align`).
        """
        groups = self.coordinator.get_blocks(request_id)
        for size, blocks in zip(self.coordinator.block_sizes, groups, strict=True):
            for block in blocks[num_tokens // size :]:
                if not block.is_null and block.ref_cnt > 1:
                    return True
        return False

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """All blocks currently held by ``request_id``, per group."""
        return KVCacheBlocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Block ids of ``request_id`` per group: row of the block table (null block = 0)."""
        groups = self.coordinator.get_blocks(request_id)
        return tuple([b.block_id for b in blocks] for blocks in groups)

    def get_num_common_prefix_blocks(
        self, running_request_id: str, num_running_requests: int
    ) -> list[int]:
        """Per group, the leading blocks shared by all ``num_running_requests`` running requests
        (for cascade attention); 0 for sliding-window and chunked-local groups."""
        return self.coordinator.get_num_common_prefix_blocks(
            running_request_id, num_running_requests
        )

    def get_num_blocks_needed(self, num_tokens: int) -> int:
        """Blocks a request of ``num_tokens`` tokens holds at most, over all groups, when it
        is computed in one step (an upper bound for admission checks)."""
        total = 0
        for manager in self.coordinator.managers:
            total += cdiv(num_tokens, manager.block_size)
        return total

    # -- accounting ------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks available now (free, including evictable cached ones)."""
        return self.block_pool.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        """Usable blocks (all but the null block)."""
        return self.block_pool.num_usable_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests, in [0, 1]."""
        return self.block_pool.usage

    @property
    def num_evictions(self) -> int:
        """Cached blocks reused for new contents since the last stats reset."""
        return self.block_pool.counters.evictions - self._evictions_at_reset

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Prefix-cache lookups, queried and hit tokens, evictions."""
        return PrefixCacheStats(
            requests=self._requests,
            queries=self._queries,
            hits=self._hits,
            evictions=self.num_evictions,
        )

    def reset_prefix_cache_stats(self) -> None:
        """Zero the counters of `prefix_cache_stats`."""
        self._requests = self._queries = self._hits = 0
        self._evictions_at_reset = self.block_pool.counters.evictions

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block hash. Refused (returns False) while any block is in use."""
        return self.block_pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant.

        Checks: free + in use + null == total; no negative or dangling reference counts; the
        hash map and the blocks agree; every block held by a request is referenced, and a
        block's ref count equals the number of tables holding it; all ref counts are zero when
        no request holds blocks.
        """
        self.block_pool.check_invariants()
        holders: dict[int, int] = {}
        for manager in self.coordinator.managers:
            for rid, blocks in manager.req_to_blocks.items():
                for block in blocks:
                    if block.is_null:
                        continue
                    if block.ref_cnt <= 0:
                        raise AssertionError(
                            f"request {rid!r} holds {block!r} whose ref count is not positive"
                        )
                    holders[block.block_id] = holders.get(block.block_id, 0) + 1
        for block in self.block_pool.blocks[1:]:
            if block.ref_cnt != holders.get(block.block_id, 0):
                raise AssertionError(
                    f"{block!r} has ref count {block.ref_cnt} but "
                    f"{holders.get(block.block_id, 0)} request tables hold it"
                )
