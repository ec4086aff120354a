"""Greedy outputs of the engine are token-identical to transformers' generate() (float32, CPU),
with logits (as log-probabilities) matching, under chunked prefill, prefix caching and forced
preemption, for every supported architecture; no block leaks afterwards."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_helpers import (
    assert_no_leak,
    check_outputs_against_hf,
    make_models,
    random_prompts,
)

from pagedcore import LLM, SamplingParams
from pagedcore.kv_cache.config import (
    group_layers,
    kv_cache_specs_from_hf_config,
    num_blocks_per_request,
    unify_page_sizes,
)

MAX_NEW = 20


def kv_bytes_for(config: Any, *, block_size: int, max_model_len: int, batched: int,
                 extra_blocks: int) -> int:
    """A KV budget of one max_model_len request plus `extra_blocks` blocks."""
    specs = kv_cache_specs_from_hf_config(config, block_size=block_size, dtype=torch.float32)
    groups = group_layers(unify_page_sizes(specs))
    per_block = groups[0].spec.page_size_bytes * max(len(g.layer_names) for g in groups)
    blocks = 1 + num_blocks_per_request(groups, max_model_len, batched) + extra_blocks
    return blocks * per_block


def check_against_hf(llm: LLM, ref: Any, prompts: list[list[int]], outs: list[Any]) -> None:
    check_outputs_against_hf(ref, prompts, outs, MAX_NEW)


def test_greedy_mixed_lengths_chunked_prefill(arch: str) -> None:
    _config, ref, eng = make_models(arch)
    llm = LLM(eng, device="cpu", block_size=4, max_model_len=128, max_num_batched_tokens=32,
              long_prefill_token_threshold=16, kv_cache_memory_bytes=1 << 20)
    prompts = random_prompts([3, 9, 17, 30, 45])
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=3)
    outs = llm.generate(prompts, params)
    check_against_hf(llm, ref, prompts, outs)
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    assert_no_leak(llm)


def test_prefix_caching_shared_prefixes(arch: str) -> None:
    _config, ref, eng = make_models(arch)
    llm = LLM(eng, device="cpu", block_size=4, max_model_len=128, max_num_batched_tokens=64,
              kv_cache_memory_bytes=1 << 20)
    prefix = random_prompts([22], seed=7)[0]
    suffixes = random_prompts([1, 5, 11], seed=8)
    prompts = [prefix + s for s in suffixes]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=2)
    first = llm.generate(prompts[:1], params)
    rest = llm.generate(prompts[1:], params)
    assert first[0].num_cached_tokens == 0
    # 22 shared tokens, block size 4: five full blocks hit.
    assert all(o.num_cached_tokens == 20 for o in rest), [o.num_cached_tokens for o in rest]
    assert llm.stats()["prefix_hit_tokens"] == 40
    check_against_hf(llm, ref, prompts, first + rest)
    assert_no_leak(llm)


def test_preemption_under_small_kv_budget(arch: str) -> None:
    config, ref, eng = make_models(arch)
    max_model_len, batched = 64, 32
    budget = kv_bytes_for(config, block_size=4, max_model_len=max_model_len, batched=batched,
                          extra_blocks=0)
    llm = LLM(eng, device="cpu", block_size=4, max_model_len=max_model_len,
              max_num_batched_tokens=batched, kv_cache_memory_bytes=budget)
    prompts = random_prompts([12, 25, 7, 19, 30, 14, 22, 9, 27, 16], seed=3)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, params)
    assert llm.stats()["preemptions"] >= 2
    assert sum(o.metrics.num_preemptions for o in outs) == llm.stats()["preemptions"]
    check_against_hf(llm, ref, prompts, outs)
    assert_no_leak(llm)


@pytest.mark.parametrize("chunked", [False, True])
def test_without_prefix_caching(chunked: bool) -> None:
    _config, ref, eng = make_models("llama")
    llm = LLM(eng, device="cpu", block_size=8, max_model_len=64,
              max_num_batched_tokens=64 if not chunked else 8,
              enable_prefix_caching=False, enable_chunked_prefill=chunked,
              kv_cache_memory_bytes=1 << 20)
    prompts = random_prompts([40, 4, 21], seed=5)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, params)
    check_against_hf(llm, ref, prompts, outs)
    assert all(o.num_cached_tokens == 0 for o in outs)
    assert_no_leak(llm)
