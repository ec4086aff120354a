"""Memory accounting of `pagedcore bench memory`, checked by hand-computed block counts."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagedcore.bench.memory import (
    _kv_config,
    contiguous_admission,
    paged_admission,
    workload_lengths,
)
from pagedcore.engine.models.loading import tiny_config

CONFIG = tiny_config("llama", max_position_embeddings=512)  # 2 layers, 2 KV heads, head 16
# Bytes of one block of all layers: 2 (K, V) * block * 2 heads * 16 dims * 4 bytes * 2 layers.


def _config(block: int, num_blocks: int, max_model_len: int = 256) -> object:
    per_block = 2 * block * 2 * 16 * 4 * 2
    return _kv_config(CONFIG, block_size=block, dtype=torch.float32,
                      budget_bytes=num_blocks * per_block, max_model_len=max_model_len)


def test_paged_admission_counts_blocks_exactly() -> None:
    cfg = _config(16, num_blocks=41)
    # 17 tokens need 2 blocks of 16: 40 usable blocks (block 0 is the null block) hold 20.
    out = paged_admission(cfg, [17] * 100, max_model_len=256)
    assert out["num_blocks"] == 41
    assert out["max_concurrency"] == 20
    assert out["allocated_slots"] == 20 * 32
    assert out["live_fraction_of_allocated"] == pytest.approx(17 / 32)
    assert out["tail_waste_fraction"] == pytest.approx(15 / 32)
    assert out["live_fraction_of_budget"] == pytest.approx(20 * 17 / (41 * 16))


def test_paged_admission_stops_at_the_first_request_that_does_not_fit() -> None:
    cfg = _config(16, num_blocks=41)
    # 10 blocks + 10 blocks + 10 blocks, then 16 blocks do not fit in the last 10.
    out = paged_admission(cfg, [160, 160, 160, 256, 16], max_model_len=256)
    assert out["max_concurrency"] == 3
    assert out["live_tokens"] == 480


def test_paged_admission_refuses_a_workload_that_never_fills_the_cache() -> None:
    with pytest.raises(ValueError, match="never filled"):
        paged_admission(_config(16, num_blocks=41), [16] * 3, max_model_len=256)


def test_contiguous_reserves_max_model_len_per_request() -> None:
    out = contiguous_admission(41 * 16, [17] * 100, max_model_len=256)
    assert out["max_concurrency"] == 2  # 656 slots // 256
    assert out["allocated_slots"] == 512
    assert out["live_fraction_of_allocated"] == pytest.approx(34 / 512)


def test_block_size_trades_tail_waste() -> None:
    lengths = workload_lengths(400, max_model_len=1000, seed=1)
    small = paged_admission(_config(8, num_blocks=2000, max_model_len=1024), lengths,
                            max_model_len=1024)
    large = paged_admission(_config(64, num_blocks=250, max_model_len=1024), lengths,
                            max_model_len=1024)
    assert small["budget_slots"] == large["budget_slots"] == 16000
    assert small["tail_waste_fraction"] < large["tail_waste_fraction"]
    assert small["max_concurrency"] >= large["max_concurrency"]
    # Tail waste is < one block per admitted request.
    for out, block in ((small, 8), (large, 64)):
        assert out["allocated_slots"] - out["live_tokens"] < block * out["max_concurrency"]


def test_workload_lengths_are_seeded_and_clipped() -> None:
    a = workload_lengths(500, max_model_len=1024, seed=4)
    assert a == workload_lengths(500, max_model_len=1024, seed=4)
    assert a != workload_lengths(500, max_model_len=1024, seed=5)
    assert min(a) >= 16 and max(a) == 1024  # the long tail is clipped


def test_fp8_kv_blocks_take_a_quarter_of_float32_and_admit_more() -> None:
    per_block = 2 * 16 * 2 * 16 * 4 * 2  # float32
    budget = 41 * per_block
    f32 = _kv_config(CONFIG, block_size=16, dtype=torch.float32, budget_bytes=budget,
                     max_model_len=256)
    fp8 = _kv_config(CONFIG, block_size=16, dtype=torch.float8_e4m3fn, budget_bytes=budget,
                     max_model_len=256)
    assert fp8.num_blocks == 4 * 41
    lengths = [17] * 200
    assert paged_admission(fp8, lengths, max_model_len=256)["max_concurrency"] == 81
    assert paged_admission(f32, lengths, max_model_len=256)["max_concurrency"] == 20


def test_kernel_speed_runs_at_the_models_heads(monkeypatch: Any) -> None:
    """The block-size timing of `bench memory` builds its caches and queries at the model's
    heads (Qwen2-0.5B: 14 query / 2 KV heads of 64), not the kernel bench's 32 / 8 / 128."""
    from pagedcore.bench import kernel_primitives as k
    from pagedcore.bench.memory import measure_kernel_speed, model_heads
    from pagedcore.engine.models.loading import qwen2_0_5b_config

    heads = model_heads(qwen2_0_5b_config())
    assert (heads.num_heads, heads.num_kv_heads, heads.head_size) == (14, 2, 64)
    assert model_heads(tiny_config("llama")).num_kv_heads == 2
    seen: list[tuple[int, ...]] = []
    real = k.BackendUnderTest.runner

    def spy(self: Any, kv: Any, query_lens: Any, reqs: Any, query: Any) -> Any:
        seen.append((*kv.key.shape[-2:], *query.shape[-2:]))
        return real(self, kv, query_lens, reqs, query)

    monkeypatch.setattr(k.BackendUnderTest, "runner", spy)
    rows = measure_kernel_speed([16], batch=2, ctx=32, device=torch.device("cpu"),
                                heads=heads)
    timed = [r for r in rows if "ms" in r]
    assert timed and all(r["block_size"] == 16 for r in timed), rows
    # KV (2 heads, 64) and query (14 heads, 64) shapes reached every backend
    assert seen and set(seen) == {(2, 64, 14, 64)}, seen
    ref = next(r for r in timed if r["backend"] == "reference")
    assert abs(ref["kv_GBps"] * ref["ms"] * 1e6 - 2 * 2 * 32 * 2 * 64 * 4) < 1e-3
