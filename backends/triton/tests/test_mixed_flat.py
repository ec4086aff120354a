"""The flat mixed-step plan: programs follow the bucket and the step, never the request slots.

A captured mixed step used to launch ``(T // BLOCK_Q + max_num_seqs) x Hkv x S`` programs with
``S`` sized for ``max_model_len``: 8192 mostly empty programs for a 16-token bucket with 64
request slots. The flat plan launches ``flat_grid_size`` programs per KV head and deals them
out at run time; these tests check its size and that it stays exact (vs the float64 formula
on NaN-poisoned caches) for any mix the contract allows in a small bucket with more request
slots than tokens, through each run-time branch (split or not, empty segments, empty
q-blocks, requests with query length 0 before the last real one).
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import pytest
import torch
from _capture import SENTINEL, CaptureBuffers, replay_layer, triton_builder
from pagedcore_triton import SplitRule, TritonAttentionBackend
from pagedcore_triton.backend import MIXED_PLAN_ENV

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 14, 2, 64, 16  # Qwen2-0.5B's GQA group of 7
NUM_REQS, TOKENS, MAX_MODEL_LEN, MAX_BLOCKS = 24, 16, 400, 25
CACHE_BLOCKS = 160
#: Up to 8 segments of >= 32 tokens, and a grid of 32 programs per KV head: one request gets
#: all 8 segments, 16 decodes get one each (the unsplit branch).
SPLIT = SplitRule(min_tokens_per_segment=32, target_programs=64)


def _builder(spec_dtype: torch.dtype = torch.float32, split: SplitRule | None = SPLIT) -> Any:
    return triton_builder(block_size=BLOCK, kv_heads=KV_HEADS, head_size=HEAD_SIZE,
                          device=DEVICE, dtype=spec_dtype, split=split)


#: A 16-token bucket with 24 request slots, rewritten in place like the engine does.
_Bucket = functools.partial(
    CaptureBuffers, num_reqs=NUM_REQS, num_tokens=TOKENS, max_blocks=MAX_BLOCKS,
    max_model_len=MAX_MODEL_LEN, heads=HEADS, kv_heads=KV_HEADS, head_size=HEAD_SIZE,
    device=DEVICE, block_size=BLOCK, cache_blocks=CACHE_BLOCKS,
)


MIXES = [
    [(180, 5)],  # one chunk over a cached prefix: all 8 segments, the last ones empty
    [(0, TOKENS)],  # a fresh prefill filling the bucket
    [(17 * i + 3, 1) for i in range(TOKENS)],  # 16 decodes: as many requests as tokens
    [(399, 1)],  # a lone decode at max_model_len
    # decodes, a request with query length 0 before the last real one, chunks
    [(50, 1), (120, 1), (100, 0), (33, 3), (64, 9), (7, 2)],
    [(2, 1), (250, 1), (1, 1), (64, 10)],  # decode-first mix with 20 padding requests
]


def test_flat_plan_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MIXED_PLAN_ENV, raising=False)
    (part,) = _builder().build_for_cudagraph_capture(_Bucket().common()).parts
    assert part.flat_programs == 32 and part.num_segments == 8
    assert part.min_segment_tokens == 32
    monkeypatch.setenv(MIXED_PLAN_ENV, "classic")
    (old,) = _builder().build_for_cudagraph_capture(_Bucket().common()).parts
    assert old.flat_programs is None


@pytest.mark.parametrize("mix", range(len(MIXES)))
def test_flat_plan_survives_in_place_rewrites(mix: int) -> None:
    buf = _Bucket()
    metadata = _builder().build_for_cudagraph_capture(buf.common())
    impls = [
        TritonAttentionBackend.get_impl_cls()(HEADS, HEAD_SIZE, 0.125, num_kv_heads=KV_HEADS),
        TritonAttentionBackend.get_impl_cls()(
            HEADS, HEAD_SIZE, 0.125, num_kv_heads=KV_HEADS, sliding_window=40
        ),
    ]
    out = torch.empty_like(buf.query)
    # Each test replays the plan after an earlier mix (stale partials from it must not leak).
    for step, reqs in enumerate((MIXES[mix - 1], MIXES[mix])):
        batch = buf.load_mixed(reqs, seed=10 * mix + step)
        t = batch.common.num_actual_tokens
        for impl in impls:
            err = replay_layer(impl, buf, batch, metadata, out)
            assert err < 1e-4, (reqs, impl.sliding_window, err)
            assert bool((out[t:] == SENTINEL).all()), (reqs, "a padding token's row written")


def _programs(builder: Any, *, tokens: int, num_reqs: int, max_model_len: int) -> int:
    from pagedcore_triton.ops import prepare_launch

    buf = CaptureBuffers(num_reqs=num_reqs, num_tokens=tokens, max_blocks=max_model_len // 16,
                         max_model_len=max_model_len, heads=HEADS, kv_heads=KV_HEADS,
                         head_size=HEAD_SIZE, device="cpu")
    buf.qsl.zero_()
    # A mixed bucket even when tokens == request slots (the helper would make it a decode).
    common = attrs.evolve(buf.common(), max_query_len=tokens)
    (part,) = builder.build_for_cudagraph_capture(common).parts
    launch = prepare_launch(
        part, query_shape=(tokens, HEADS, HEAD_SIZE), dtype=torch.bfloat16,
        kv_cache_shape=(2, 4096, 16, KV_HEADS, HEAD_SIZE), query_start_loc=buf.qsl,
        seq_lens=buf.seq_lens, block_table=buf.table, causal=True, use_alibi=False,
        sliding_window=None, logits_soft_cap=None,
    )
    assert launch.grid is not None
    gx, gy, gz = launch.grid
    return gx * gy * gz


@pytest.mark.parametrize("tokens", [16, 32, 64])
def test_flat_grid_follows_the_bucket(tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench's engines (64 request slots, 17-41K max_model_len, default split rule):
    at most ~4 programs per SM (the split budget, 512), whatever the request slots."""
    monkeypatch.delenv(MIXED_PLAN_ENV, raising=False)
    builder = _builder(torch.bfloat16, split=None)
    counts = {
        (r, m): _programs(builder, tokens=tokens, num_reqs=r, max_model_len=m)
        for r in (64, 256) for m in (17408, 33024, 40960)
    }
    assert max(counts.values()) <= SplitRule().target_programs, counts
    monkeypatch.setenv(MIXED_PLAN_ENV, "classic")  # what the flat grid replaced
    old = _programs(builder, tokens=tokens, num_reqs=64, max_model_len=17408)
    assert old >= 8 * counts[(64, 17408)], (old, counts)
