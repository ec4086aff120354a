"""Physical KV-cache blocks, the free queue and the prefix-cache map.

The pool owns ``num_blocks`` blocks shared by every KV-cache group. Block 0 is the null block:
it is never handed out and stands in block tables for positions whose K/V is no longer needed
(outside a sliding window). A block with ``ref_cnt == 0`` sits in the free queue; if it still
carries a hash it also sits in the prefix-cache map, and a later request can `touch` it back to
life. The free queue's order is the eviction order: its head is reused first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import final

import attrs

from pagedcore.kv_cache.hashing import BlockHash

__all__ = ["BlockHashKey", "BlockPool", "FreeBlockQueue", "KVCacheBlock", "PoolCounters"]

#: A prefix-cache key: the block hash and the KV-cache group the block belongs to (the same
#: tokens give a different physical block in each group).
BlockHashKey = tuple[BlockHash, int]


@final
class KVCacheBlock:
    """One physical block: id, reference count, prefix-cache key, free-queue links."""

    __slots__ = ("block_hash", "block_id", "is_null", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        #: Set while the block is registered in the prefix-cache map.
        self.block_hash: BlockHashKey | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        cached = "cached" if self.block_hash is not None else "uncached"
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, {cached})"


@final
class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks with O(1) popleft, append and remove.

    The links live in the blocks themselves (``prev_free`` / ``next_free``), between two
    sentinel blocks, so removing a block from the middle (a prefix-cache hit on a free block)
    never scans.
    """

    __slots__ = ("_head", "_tail", "num_free_blocks")

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the first free block (the next to be reused)."""
        first = self._head.next_free
        if first is self._tail or first is None:
            raise ValueError("no free blocks left")
        self._unlink(first)
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the first ``n`` free blocks, in order."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} left")
        out: list[KVCacheBlock] = []
        block = self._head.next_free
        for _ in range(n):
            assert block is not None
            out.append(block)
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block = nxt
        assert block is not None
        self._head.next_free = block
        block.prev_free = self._head
        self.num_free_blocks -= n
        return out

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail (reused last)."""
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the head (reused first)."""
        first = self._head.next_free
        assert first is not None
        self._head.next_free = block
        block.prev_free = self._head
        block.next_free = first
        first.prev_free = block
        self.num_free_blocks += 1

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from anywhere in the queue."""
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"{block!r} is not in the free queue")
        self._unlink(block)

    def _unlink(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks, head first (for tests and invariant checks)."""
        out: list[KVCacheBlock] = []
        block = self._head.next_free
        while block is not None and block is not self._tail:
            out.append(block)
            block = block.next_free
        return out


@attrs.define
class PoolCounters:
    """Running totals kept by the pool."""

    evictions: int = 0


@final
class BlockPool:
    """All physical blocks, the free queue and the hash -> block map.

    Parameters
    ----------
    num_blocks : int
        Total blocks, including the null block 0. Must be >= 2.
    enable_caching : bool
        Whether full blocks are registered for prefix-cache hits.
    """

    def __init__(self, num_blocks: int, *, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"a block pool needs at least 2 blocks (the null block and one usable), got "
                f"{num_blocks}; give the KV cache more memory or use a smaller block_size"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.null_block = self.free_queue.popleft()
        self.null_block.is_null = True
        self.cached: dict[BlockHashKey, KVCacheBlock] = {}
        # Blocks holding the same contents as a cached block (two requests computed the same
        # prefix at once). They stand in when the cached one is evicted.
        self.duplicates: dict[BlockHashKey, list[KVCacheBlock]] = {}
        self.counters = PoolCounters()

    # -- queries ---------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, cached or not)."""
        return self.free_queue.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        """All blocks but the null block."""
        return self.num_blocks - 1

    @property
    def usage(self) -> float:
        """Fraction of usable blocks referenced by some request, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash, group_id: int) -> KVCacheBlock | None:
        """The block caching ``block_hash`` in group ``group_id``, or None."""
        return self.cached.get((block_hash, group_id))

    # -- state changes ---------------------------------------------------------------------------

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Hand out ``n`` blocks with ``ref_cnt = 1``, evicting their old cache entries."""
        if n > self.free_queue.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, only {self.num_free_blocks} free")
        blocks = self.free_queue.popleft_n(n)
        for block in blocks:
            if block.block_hash is not None:
                # Reusing a cached block: its old contents are about to be overwritten.
                self._uncache(block)
                self.counters.evictions += 1
            block.ref_cnt = 1
        return blocks

    def _uncache(self, block: KVCacheBlock) -> None:
        key = block.block_hash
        assert key is not None
        block.block_hash = None
        dups = self.duplicates.get(key)
        if self.cached.get(key) is block:
            if dups:
                self.cached[key] = dups.pop()
            else:
                del self.cached[key]
        elif dups is not None:
            dups.remove(block)
        if dups is not None and not dups:
            del self.duplicates[key]

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on each block (prefix hit); a free one leaves the free queue."""
        queue = self.free_queue
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                # `FreeBlockQueue.remove`, inlined: a warm hit touches hundreds of blocks
                # inside its time to first token.
                prev, nxt = block.prev_free, block.next_free
                if prev is None or nxt is None:
                    raise ValueError(f"{block!r} is not in the free queue")
                prev.next_free = nxt
                nxt.prev_free = prev
                block.prev_free = block.next_free = None
                queue.num_free_blocks -= 1
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block, in the given order (pass a request's blocks
        reversed so its tail is evicted before its head).

        A block reaching zero references joins the free queue: uncached blocks at the head
        (reused first, nothing is lost), cached blocks at the tail (LRU eviction order).
        """
        queue = self.free_queue
        appendleft = queue.appendleft
        tail = queue._tail
        for block in ordered_blocks:
            if block.is_null:
                continue
            ref_cnt = block.ref_cnt
            if ref_cnt <= 0:
                raise AssertionError(f"double free of {block!r}")
            block.ref_cnt = ref_cnt = ref_cnt - 1
            if ref_cnt == 0:
                if block.block_hash is None:
                    appendleft(block)
                else:
                    # `FreeBlockQueue.append`, inlined (a finished request frees every block).
                    last = tail.prev_free
                    assert last is not None
                    last.next_free = block
                    block.prev_free = last
                    block.next_free = tail
                    tail.prev_free = block
                    queue.num_free_blocks += 1

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        *,
        start: int,
        end: int,
        group_id: int,
    ) -> None:
        """Register ``blocks[start:end]`` under ``block_hashes[start:end]`` in group ``group_id``.

        Null blocks are skipped. A hash already cached by another block (the same prefix
        computed by two requests at once) records the new block as a duplicate, which takes over
        if the first one is evicted.
        """
        if not self.enable_caching:
            return
        cached = self.cached
        for i in range(start, end):
            block = blocks[i]
            if block.is_null or block.block_hash is not None:
                continue
            key = (block_hashes[i], group_id)
            block.block_hash = key
            if key in cached:
                self.duplicates.setdefault(key, []).append(block)
            else:
                cached[key] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (returns False) while any block is in use."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self.cached.values():
            block.block_hash = None
        for dups in self.duplicates.values():
            for block in dups:
                block.block_hash = None
        self.cached.clear()
        self.duplicates.clear()
        return True

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken pool invariant."""
        free = self.free_queue.get_all_free_blocks()
        if len(free) != self.free_queue.num_free_blocks:
            raise AssertionError(
                f"free queue holds {len(free)} blocks but counts {self.free_queue.num_free_blocks}"
            )
        free_ids = {b.block_id for b in free}
        if len(free_ids) != len(free):
            raise AssertionError("a block appears twice in the free queue")
        if self.null_block.block_id in free_ids:
            raise AssertionError("the null block is in the free queue")
        in_use = 0
        for block in self.blocks[1:]:
            if block.ref_cnt < 0:
                raise AssertionError(f"negative ref count: {block!r}")
            if block.ref_cnt == 0 and block.block_id not in free_ids:
                raise AssertionError(f"{block!r} is unreferenced but not in the free queue")
            if block.ref_cnt > 0:
                in_use += 1
                if block.block_id in free_ids:
                    raise AssertionError(f"{block!r} is referenced but in the free queue")
            key = block.block_hash
            if (
                key is not None
                and self.cached.get(key) is not block
                and block not in self.duplicates.get(key, ())
            ):
                raise AssertionError(f"{block!r} has a hash the cache map does not point back to")
        if in_use + len(free) + 1 != self.num_blocks:
            raise AssertionError(
                f"free ({len(free)}) + in use ({in_use}) + null (1) != total ({self.num_blocks})"
            )
        for key, block in self.cached.items():
            if block.block_hash != key:
                raise AssertionError(f"cache map entry points to {block!r} holding another hash")
            if block.is_null:
                raise AssertionError("the null block is in the cache map")
        for key, dups in self.duplicates.items():
            if key not in self.cached or not dups:
                raise AssertionError("a duplicate entry without a primary cached block")
            for block in dups:
                if block.block_hash != key or block is self.cached[key]:
                    raise AssertionError(f"bad duplicate entry {block!r}")
