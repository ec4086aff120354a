"""Block pool and free queue: O(1) links, null block, eviction, touch, reset, invariants."""

from __future__ import annotations

import pytest

from pagedcore.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def test_free_queue_operations() -> None:
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeBlockQueue(blocks)
    assert q.num_free_blocks == 6
    assert q.popleft() is blocks[0]
    q.remove(blocks[3])
    assert ids(q.get_all_free_blocks()) == [1, 2, 4, 5]
    q.append(blocks[3])
    q.appendleft(blocks[0])
    assert ids(q.get_all_free_blocks()) == [0, 1, 2, 4, 5, 3]
    assert ids(q.popleft_n(3)) == [0, 1, 2]
    assert ids(q.get_all_free_blocks()) == [4, 5, 3] and q.num_free_blocks == 3
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(blocks[0])
    with pytest.raises(ValueError, match="only 3 left"):
        q.popleft_n(4)
    q.popleft_n(3)
    with pytest.raises(ValueError, match="no free blocks"):
        q.popleft()


def test_null_block_is_reserved() -> None:
    pool = BlockPool(5)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.num_free_blocks == 4
    got = pool.get_new_blocks(4)
    assert 0 not in ids(got)
    assert pool.usage == 1.0
    pool.free_blocks([pool.null_block])  # ignored
    assert pool.num_free_blocks == 0
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockPool(1)


def test_free_order_uncached_first_then_lru_tail_first() -> None:
    pool = BlockPool(8)
    a = pool.get_new_blocks(3)  # ids 1, 2, 3
    pool.cache_full_blocks(a, [b"h1", b"h2"], start=0, end=2, group_id=0)
    pool.free_blocks(reversed(a))  # 3 (uncached) -> head; 2, 1 -> tail in that order
    assert ids(pool.free_queue.get_all_free_blocks()) == [3, 4, 5, 6, 7, 2, 1]
    # Reuse evicts: allocate everything; the cached blocks lose their hashes, tail last.
    got = pool.get_new_blocks(7)
    assert ids(got) == [3, 4, 5, 6, 7, 2, 1]
    assert pool.counters.evictions == 2 and not pool.cached
    assert all(b.block_hash is None for b in got)
    pool.check_invariants()


def test_touch_revives_a_free_cached_block() -> None:
    pool = BlockPool(4)
    (blk,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([blk], [b"h"], start=0, end=1, group_id=0)
    pool.free_blocks([blk])
    assert pool.get_cached_block(b"h", 0) is blk and pool.get_cached_block(b"h", 1) is None
    assert pool.num_free_blocks == 3
    pool.touch([blk, pool.null_block])
    assert blk.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.touch([blk])
    assert blk.ref_cnt == 2
    pool.check_invariants()
    pool.free_blocks([blk, blk])
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([blk])


def test_duplicate_takes_over_when_the_cached_block_is_evicted() -> None:
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [b"h"], start=0, end=1, group_id=0)
    pool.cache_full_blocks([b], [b"h"], start=0, end=1, group_id=0)
    assert pool.get_cached_block(b"h", 0) is a and pool.duplicates[(b"h", 0)] == [b]
    pool.check_invariants()
    pool.free_blocks([a])
    assert pool.get_new_blocks(2)[1] is a  # free block 3 first, then evict a
    assert pool.get_cached_block(b"h", 0) is b and not pool.duplicates
    pool.check_invariants()
    pool.free_blocks([b])
    pool.get_new_blocks(1)
    assert pool.get_cached_block(b"h", 0) is None
    pool.check_invariants()


def test_caching_disabled_registers_nothing() -> None:
    pool = BlockPool(4, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [b"x", b"y"], start=0, end=2, group_id=0)
    assert not pool.cached


def test_reset_prefix_cache_refused_while_in_use() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, [b"h"], start=0, end=1, group_id=0)
    assert pool.reset_prefix_cache() is False and pool.cached
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert not pool.cached and blocks[0].block_hash is None


def test_check_invariants_names_what_broke() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    blocks[0].ref_cnt = 0  # referenced count lost, but not in the free queue
    with pytest.raises(AssertionError, match="not in the free queue"):
        pool.check_invariants()
