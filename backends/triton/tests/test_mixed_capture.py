"""The mixed-step CUDA-graph plan: built once for a token bucket, valid for any later mix.

`build_for_cudagraph_capture` with ``max_query_len == num_actual_tokens == T`` plans one
launch over every request slot and all ``T`` token slots. The buffers are then rewritten in
place with different mixes (decodes, chunks continuing a cached prefix, fresh prefills,
padding requests with query length 0 and ``seq_lens`` 0, padding tokens with slot -1), and
`forward` must match the float64 formula on the real tokens of NaN-poisoned caches, leave
the padding tokens' output rows alone and write nothing through slot -1.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from _capture import SENTINEL, CaptureBuffers, replay_layer, triton_builder
from pagedcore_triton import SplitRule, TritonAttentionBackend

from pagedcore.attention import CommonAttentionMetadata
from pagedcore.kv_cache.spec import FullAttentionSpec

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 8, 2, 64, 16
NUM_REQS, TOKENS, MAX_MODEL_LEN, MAX_BLOCKS = 6, 48, 200, 13
CACHE_BLOCKS = 40


#: The engine's persistent buffers of one mixed token bucket.
_MixedBuffers = functools.partial(
    CaptureBuffers, num_reqs=NUM_REQS, num_tokens=TOKENS, max_blocks=MAX_BLOCKS,
    max_model_len=MAX_MODEL_LEN, heads=HEADS, kv_heads=KV_HEADS, head_size=HEAD_SIZE,
    device=DEVICE, block_size=BLOCK, cache_blocks=CACHE_BLOCKS,
)


MIXES = [
    # decodes, a chunk continuing a cached prefix, a fresh prefill; 2 padding requests
    [(30, 1), (17, 1), (40, 12), (0, 9)],
    [(0, TOKENS)],  # one fresh prefill filling the bucket, 5 padding requests
    # six requests, no padding request; chunks crossing block boundaries
    [(5, 1), (100, 1), (63, 1), (16, 1), (0, 20), (31, 17)],
    [(64, 16)],  # a lone chunk on a block boundary
    [(199, 1)],  # a lone decode at max_model_len
]


def _builder(split: SplitRule | None = None) -> Any:
    return triton_builder(block_size=BLOCK, kv_heads=KV_HEADS, head_size=HEAD_SIZE,
                          device=DEVICE, split=split)


#: Splits the 200-token max_seq_len into 2 segments of >= 64 tokens (the default rule keeps
#: one pass: 200 // 2 < 256); short contexts leave the second segment empty.
FORCED_SPLIT = SplitRule(min_tokens_per_segment=64)


@pytest.mark.parametrize("split", [None, FORCED_SPLIT])
def test_mixed_plan_is_one_unified_launch(split: SplitRule | None) -> None:
    metadata = _builder(split).build_for_cudagraph_capture(_MixedBuffers().common())
    (part,) = metadata.parts
    assert (part.req_begin, part.req_end, part.token_begin, part.token_end) == (
        0, NUM_REQS, 0, TOKENS)
    assert part.max_query_len == TOKENS and part.num_segments == (1 if split is None else 2)


def test_mixed_split_comes_from_shapes_only() -> None:
    """Qwen2-0.5B-like (2 KV heads): small buckets split long contexts, big ones do not."""
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    builder = TritonAttentionBackend.get_builder_cls()(spec, ["l0"], torch.device(DEVICE))
    seg = builder._mixed_segments
    assert [seg(t, 5120) for t in (16, 64, 512, 1024, 2048, 4096, 8192)] == [
        16, 16, 8, 4, 2, 1, 1]
    assert seg(512, 33024) == 8 and seg(16, 33024) == 64 and seg(64, 300) == 1


@pytest.mark.parametrize("split", [None, FORCED_SPLIT])
def test_mixed_plan_survives_in_place_rewrites(split: SplitRule | None) -> None:
    buf = _MixedBuffers()
    metadata = _builder(split).build_for_cudagraph_capture(buf.common())
    impls = [
        TritonAttentionBackend.get_impl_cls()(HEADS, HEAD_SIZE, 0.125, num_kv_heads=KV_HEADS),
        TritonAttentionBackend.get_impl_cls()(
            HEADS, HEAD_SIZE, 0.125, num_kv_heads=KV_HEADS, sliding_window=24
        ),
    ]
    out = torch.empty_like(buf.query)
    keys = set()
    for seed, reqs in enumerate(MIXES):
        batch = buf.load_mixed(reqs, seed)
        keys |= {(batch.kv_cache.shape, impl.sliding_window) for impl in impls}
        t = batch.common.num_actual_tokens
        null_block = batch.kv_cache[:, 0].clone()
        for impl in impls:  # two layers sharing the plan (and its prepared launch)
            err = replay_layer(impl, buf, batch, metadata, out)
            assert err < 1e-4, (reqs, impl.sliding_window, err)
            if split is None:  # (the split merge also writes padding rows, discarded)
                # No program wrote a padding token's row.
                assert bool((out[t:] == SENTINEL).all()), (reqs, "padding rows written")
        assert torch.equal(batch.kv_cache[:, 0].isnan(), null_block.isnan())
    assert len(keys) == 2 and len(metadata.launches) == 2  # prepared once per layer shape


def test_capture_plan_still_rejects_partial_prefill_shapes() -> None:
    common = _MixedBuffers().common()
    bad = CommonAttentionMetadata(**{**{a: getattr(common, a) for a in (
        "query_start_loc", "query_start_loc_cpu", "seq_lens", "seq_lens_cpu", "num_reqs",
        "num_actual_tokens", "max_seq_len", "block_table", "slot_mapping", "positions")},
        "max_query_len": 5})
    with pytest.raises(ValueError, match="mixed token buckets"):
        _builder().build_for_cudagraph_capture(bad)
