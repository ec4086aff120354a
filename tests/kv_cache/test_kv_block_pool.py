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


def _reference_free(pool: BlockPool, blocks: list[KVCacheBlock]) -> None:
    """`BlockPool.free_blocks` spelled with the queue's own operations, one block at a time."""
    for block in blocks:
        if block.is_null:
            continue
        assert block.ref_cnt > 0
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            if block.block_hash is None:
                pool.free_queue.appendleft(block)
            else:
                pool.free_queue.append(block)


def _reference_touch(pool: BlockPool, blocks: list[KVCacheBlock]) -> None:
    for block in blocks:
        if block.is_null:
            continue
        if block.ref_cnt == 0:
            pool.free_queue.remove(block)
        block.ref_cnt += 1


def _state(pool: BlockPool) -> tuple[list[int], int, list[int]]:
    return (ids(pool.free_queue.get_all_free_blocks()), pool.num_free_blocks,
            [b.ref_cnt for b in pool.blocks])


def test_inlined_free_and_touch_match_the_queue_operations() -> None:
    """The pool's inlined `free_blocks` / `touch` (hot paths of a warm prefix hit) leave the
    same queue order, counts and references as the free queue's own one-block operations,
    over random mixes of cached, uncached, shared and null blocks (an uncached block between
    cached ones, a queue emptied first, ...): a guard for any faster rewrite of either."""
    import random

    rng = random.Random(0)
    for trial in range(300):
        pools = [BlockPool(12), BlockPool(12)]
        held: list[list[int]] = []  # per "request": its block ids (both pools alike)
        for _op in range(30):
            kind = rng.random()
            fast, ref = pools
            if kind < 0.4 and fast.num_free_blocks:
                n = rng.randint(1, fast.num_free_blocks)
                got = [p.get_new_blocks(n) for p in pools]
                assert ids(got[0]) == ids(got[1])
                # Cache some of them (the same ones in both pools).
                for i in range(len(got[0])):
                    if rng.random() < 0.6:
                        key = (bytes([trial % 256, i, len(held)]) * 11, 0)
                        for p, blocks in zip(pools, got, strict=True):
                            p.cache_full_blocks([blocks[i]], [key[0]], start=0, end=1,
                                                group_id=0)
                held.append(ids(got[0]))
            elif kind < 0.75 and held:
                row = held.pop(rng.randrange(len(held)))
                if rng.random() < 0.3:
                    row = [0, *row]  # (a null block in the list, as a sliding window has)
                if rng.random() < 0.5:
                    row.reverse()
                fast.free_blocks([fast.blocks[i] for i in row])
                _reference_free(ref, [ref.blocks[i] for i in row])
            else:
                cached = [b.block_id for b in fast.blocks if b.block_hash is not None]
                if not cached:
                    continue
                row = rng.sample(cached, rng.randint(1, len(cached)))
                if rng.random() < 0.3:
                    row.insert(rng.randrange(len(row) + 1), 0)
                fast.touch([fast.blocks[i] for i in row])
                _reference_touch(ref, [ref.blocks[i] for i in row])
                held.append([i for i in row if i])
            assert _state(fast) == _state(ref)
            fast.check_invariants()


def test_double_free_leaves_the_queue_consistent() -> None:
    pool = BlockPool(6)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [b"h" * 32], start=0, end=1, group_id=0)
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([a, b, b])  # a and b are freed before the error
    assert pool.num_free_blocks == 5 and ids(pool.free_queue.get_all_free_blocks())[0] == b.block_id
    pool.check_invariants()


def test_num_blocks_to_allocate_counts_free_hit_blocks_not_the_null_block() -> None:
    from pagedcore.kv_cache.single_type import FullAttentionManager
    from pagedcore.kv_cache.spec import FullAttentionSpec

    pool = BlockPool(10)
    manager = FullAttentionManager(
        FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float32"), pool,
        group_id=0)
    blocks = pool.get_new_blocks(4)
    pool.free_blocks(blocks[2:])  # two free, two referenced
    hit = [pool.null_block, *blocks]
    # 4 new blocks for 32 tokens past the 5 hit ones... plus the 2 free hit blocks revived.
    assert manager.get_num_blocks_to_allocate("r", 36, hit) == (9 - 5) + 2
    assert manager.get_num_blocks_to_allocate("r", 36, []) == 9
