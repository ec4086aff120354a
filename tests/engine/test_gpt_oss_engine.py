"""A GPT-OSS-style model through the engine: per-head attention sinks on alternating windowed
(12) and full layers, transformers' own MoE. Greedy tokens identical to transformers'
``generate()`` (eager attention, float32, CPU), log-probabilities within 1e-4, with chunked
prefill and prefix caching."""

from __future__ import annotations

import torch
from engine_helpers import (
    assert_no_leak,
    check_outputs_against_hf,
    hf_greedy,
    make_models,
    random_prompts,
)

from pagedcore.engine.llm import LLM
from pagedcore.engine.sampling.sampling_params import SamplingParams

MAX_NEW = 12


def test_gpt_oss_greedy_matches_transformers_with_chunked_prefill_and_prefix_cache() -> None:
    _config, ref, eng = make_models("gpt_oss")
    with torch.no_grad():  # sinks large enough to matter (init gives N(0, 0.1))
        for layer in (ref, eng):
            for i, block in enumerate(layer.model.layers):
                block.self_attn.sinks.copy_(torch.linspace(-1.0, 2.0, 4) + 0.5 * i)
    llm = LLM(eng, device="cpu", block_size=4, max_model_len=128, max_num_batched_tokens=16,
              enforce_eager=True)
    prompts = random_prompts([5, 30, 19])
    shared = prompts[1][:20] + random_prompts([6], seed=3)[0]  # a cached 20-token prefix
    prompts.append(shared)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=2)
    first = llm.generate(prompts[:3], params)
    second = llm.generate(prompts[3:], params)
    assert llm.stats()["prefix_hit_tokens"] > 0
    check_outputs_against_hf(ref, prompts, first + second, MAX_NEW)
    assert_no_leak(llm)


def test_gpt_oss_sinks_matter() -> None:
    """The same model with its sinks dropped gives other log-probabilities (the test above
    would catch an engine that ignored them)."""
    _config, _ref, eng = make_models("gpt_oss")
    with torch.no_grad():
        for block in eng.model.layers:
            block.self_attn.sinks.fill_(2.0)
    prompt = random_prompts([24])[0]
    _, with_sinks = hf_greedy(eng, prompt, 2)
    with torch.no_grad():
        for block in eng.model.layers:
            block.self_attn.sinks.fill_(-1e4)
    _, without = hf_greedy(eng, prompt, 2)
    assert (with_sinks - without).abs().max() > 1e-2
