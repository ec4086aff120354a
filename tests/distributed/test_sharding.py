"""Sharding math, per-rank configs, bad sizes and the step plan, in one process (no spawning)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from pagedcore import LLM, SamplingParams
from pagedcore.engine.distributed.plan import make_plan, scheduled_from_plan
from pagedcore.engine.distributed.sharding import check_shardable, rank_config, shard_model
from pagedcore.engine.distributed.worker import parse_fault
from pagedcore.engine.models.loading import random_model, tiny_config
from pagedcore.engine.runner.input_batch import InputBatch
from pagedcore.engine.scheduling.request import Request
from pagedcore.engine.scheduling.scheduler_types import ScheduledRequest

CPU = torch.device("cpu")


def _shards(arch: str, n: int) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    model = random_model(tiny_config(arch), dtype=torch.float32, device=CPU)
    shards = []
    for rank in range(n):
        copy_ = copy.deepcopy(model)
        shard_model(copy_, rank=rank, world_size=n, all_reduce=lambda t: None)
        shards.append(copy_)
    return model, shards


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases are sliced too
def test_partial_sums_equal_full_layer(arch: str) -> None:
    model, shards = _shards(arch, 2)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    full = model.model.layers[0]
    parts = [s.model.layers[0] for s in shards]
    # MLP: the ranks' partial outputs (before the all-reduce) sum to the full MLP.
    mlp = sum(p.mlp(x) for p in parts)
    assert torch.allclose(mlp, full.mlp(x), atol=1e-5)
    # Attention projections: rank r holds heads [2r, 2r+2) of q and KV head r of k/v.
    attn, sharded = full.self_attn, [p.self_attn for p in parts]
    for name in ("q_proj", "k_proj", "v_proj"):
        joined = torch.cat([getattr(s, name)(x) for s in sharded], dim=-1)
        assert torch.allclose(joined, getattr(attn, name)(x), atol=1e-6), name
    o_in = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    o = sum(s.o_proj(o_in[:, 32 * r : 32 * (r + 1)]) for r, s in enumerate(sharded))
    assert torch.allclose(o, attn.o_proj(o_in), atol=1e-5)
    assert sharded[0].k_proj.out_features == 16


def test_rank_config_divides_heads_and_keeps_head_dim() -> None:
    config = tiny_config("llama", head_dim=None, hidden_size=64)
    per_rank = rank_config(config, 2)
    assert (per_rank.num_attention_heads, per_rank.num_key_value_heads) == (2, 1)
    assert per_rank.head_dim == 16 and per_rank.intermediate_size == 64
    assert config.num_attention_heads == 4  # the original is untouched


def test_bad_sizes_are_clear_errors() -> None:
    with pytest.raises(ValueError, match=r"num_key_value_heads=2.*Sizes that work .*\[1, 2\]"):
        check_shardable(tiny_config("llama"), 4)
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        check_shardable(tiny_config("llama"), 3)
    with pytest.raises(ValueError, match="supports model types"):
        check_shardable(tiny_config("deepseek_v2"), 2)
    with pytest.raises(ValueError, match="positive integer"):
        check_shardable(tiny_config("llama"), 0)
    # Rejected by LLM before any process is spawned.
    with pytest.raises(ValueError, match="does not divide"):
        LLM(tiny_config("llama"), device="cpu", tensor_parallel_size=3)
    model = random_model(tiny_config("llama"), dtype=torch.float32, device=CPU)
    with pytest.raises(ValueError, match="not a loaded model"):
        LLM(model, device="cpu", tensor_parallel_size=2)


def test_parse_fault() -> None:
    assert parse_fault(None) is None and parse_fault("1:3") == (1, 3)
    assert parse_fault("2:setup") == (2, -1) and parse_fault("1:join") == (1, -2)
    assert parse_fault("1:init") == (1, -3) and parse_fault("1:group") == (1, -4)
    with pytest.raises(ValueError, match="RANK:STEP"):
        parse_fault("1")


def _assert_same_step_inputs(got: Any, ref: Any) -> None:
    """Token ids, positions and every group's slots, block table, lengths and offsets equal."""
    assert torch.equal(got.input_ids, ref.input_ids)
    assert torch.equal(got.positions, ref.positions)
    for a, b in zip(got.common, ref.common, strict=True):
        assert torch.equal(a.slot_mapping, b.slot_mapping)
        assert torch.equal(a.block_table, b.block_table)
        assert torch.equal(a.seq_lens, b.seq_lens)
        assert torch.equal(a.query_start_loc, b.query_start_loc)


def test_plan_rebuilds_identical_inputs_without_logits() -> None:
    params = SamplingParams(max_tokens=4)
    reqs = [Request(f"r{i}", list(range(3 + i, 40 + 7 * i)), params, arrival_index=i)
            for i in range(3)]
    # A decode (1 token at 36), a chunk in the middle of a prompt, a whole prompt.
    scheduled = [ScheduledRequest(reqs[0], 36, 1), ScheduledRequest(reqs[1], 8, 12),
                 ScheduledRequest(reqs[2], 0, 49)]
    # Distinct, permuted block ids per request and group (block 0 is the null block).
    perm = torch.randperm(120, generator=torch.Generator().manual_seed(3)).add(1).tolist()
    need = {"r0": 10, "r1": 5, "r2": 13}
    blocks: dict[str, tuple[list[int], ...]] = {}
    for rid, n in need.items():
        blocks[rid] = (perm[:n], perm[n : 2 * n])
        perm = perm[2 * n :]

    def batch() -> InputBatch:
        return InputBatch(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=128,
                          block_sizes=[4, 4], device=CPU)

    ref = batch().prepare(scheduled, blocks.__getitem__)
    plan = make_plan(7, scheduled, blocks.__getitem__)
    assert plan.step == 7 and plan.requests[1].token_ids == tuple(range(12, 24))
    again, lookup = scheduled_from_plan(plan)
    got = batch().prepare(again, lookup)
    _assert_same_step_inputs(got, ref)
    assert ref.logits_indices.numel() == 2  # r0 (decode) and r2 (whole prompt) sample
    assert got.logits_indices.numel() == 0  # workers compute no logits


def test_plan_rebuilds_a_padded_decode_step() -> None:
    # A CUDA-graph decode step (inputs padded to a bucket): the worker's planned views go
    # through the decode fast path, which indexes the token list by position.
    params = SamplingParams(max_tokens=4)
    reqs = [Request(f"r{i}", list(range(5 + i, 30 + 3 * i)), params, arrival_index=i)
            for i in range(3)]
    scheduled = [ScheduledRequest(r, r.num_tokens - 1, 1) for r in reqs]
    blocks = {f"r{i}": ([3 * i + 1, 3 * i + 2, 3 * i + 3, 20 + 3 * i, 21 + 3 * i,
                         22 + 3 * i, 30 + 2 * i, 31 + 2 * i],) for i in range(3)}

    def batch() -> InputBatch:
        return InputBatch(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=128,
                          block_sizes=[4], device=CPU)

    ref = batch().prepare(scheduled, blocks.__getitem__, pad_to=4)
    again, lookup = scheduled_from_plan(make_plan(3, scheduled, blocks.__getitem__))
    got = batch().prepare(again, lookup, pad_to=4)
    assert got.input_ids.tolist() == [r.all_token_ids[-1] for r in reqs] + [0]
    _assert_same_step_inputs(got, ref)
