"""The hybrid coordinator's hit equals a brute-force search on small random cases."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
from kv_fakes import chunked_spec, config_for, first_needed_block, full_spec, sliding_spec

from pagedcore.kv_cache.block_pool import BlockPool, KVCacheBlock
from pagedcore.kv_cache.coordinator import HybridCoordinator, UnitaryCoordinator
from pagedcore.kv_cache.spec import AttentionSpec

MAX_TOKENS = 24

spec_strategy = st.one_of(
    st.builds(full_spec, st.sampled_from([2, 4])),
    st.builds(sliding_spec, st.sampled_from([2, 4]), st.integers(1, 10)),
    st.builds(chunked_spec, st.sampled_from([2, 4]), st.sampled_from([2, 4, 6, 8])),
)


@st.composite
def cases(draw: st.DrawFn) -> tuple[list[AttentionSpec], list[set[int]], int]:
    specs = draw(st.lists(spec_strategy, min_size=1, max_size=3))
    cached = [
        draw(st.sets(st.integers(0, MAX_TOKENS // s.block_size - 1))) for s in specs
    ]
    max_length = draw(st.integers(0, MAX_TOKENS))
    return specs, cached, max_length


def brute_force(specs: list[AttentionSpec], cached: list[set[int]], max_length: int) -> int:
    lcm = math.lcm(*(s.block_size for s in specs))
    for length in range(max_length // lcm * lcm, 0, -lcm):
        if all(
            all(j in cached[g] for j in range(first_needed_block(s, length),
                                              length // s.block_size))
            for g, s in enumerate(specs)
        ):
            return length
    return 0


@settings(max_examples=300, deadline=None)
@given(cases())
def test_hybrid_hit_matches_brute_force(
    case: tuple[list[AttentionSpec], list[set[int]], int],
) -> None:
    specs, cached, max_length = case
    config = config_for(specs, 2 + sum(len(c) for c in cached))
    pool = BlockPool(config.num_blocks)
    coordinator = (HybridCoordinator if len(specs) > 1 else UnitaryCoordinator)(config, pool)
    hashes = [[bytes([g, j]) for j in range(MAX_TOKENS)] for g in range(len(specs))]
    stored: list[dict[int, KVCacheBlock]] = []
    for g, indices in enumerate(cached):
        blocks = pool.get_new_blocks(len(indices))
        by_index = dict(zip(sorted(indices), blocks, strict=True))
        for j, block in by_index.items():
            pool.cache_full_blocks([block], [hashes[g][j]], start=0, end=1, group_id=g)
        pool.free_blocks(blocks)
        stored.append(by_index)

    hit, length = coordinator.find_longest_cache_hit(hashes, max_length)
    assert length == brute_force(specs, cached, max_length)
    for g, spec in enumerate(specs):
        k = length // spec.block_size
        first = first_needed_block(spec, length) if length else 0
        assert len(hit[g]) == k
        assert all(b is pool.null_block for b in hit[g][:first])
        assert [b.block_id for b in hit[g][first:]] == [
            stored[g][j].block_id for j in range(first, k)
        ]
    pool.check_invariants()  # lookups change nothing
    assert pool.num_free_blocks == pool.num_usable_blocks
