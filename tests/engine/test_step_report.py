"""`LLM.last_step_num_scheduled_tokens`: the engine's own count of each step's tokens."""

from __future__ import annotations

import pytest
from engine_helpers import make_models, random_prompts

from pagedcore import LLM, SamplingParams
from pagedcore.engine.output_builder import (
    ParentRequest,
    make_children,
    normalize_prompts,
    tokenize,
)

THREE = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def _llm(**kw: object) -> LLM:
    _config, _ref, eng = make_models("llama")
    return LLM(eng, device="cpu", block_size=4, max_model_len=64, max_num_batched_tokens=32,
               kv_cache_memory_bytes=1 << 20, **kw)  # type: ignore[arg-type]


def test_counts_prefill_chunks_decodes_and_prefix_hits() -> None:
    llm = _llm()
    assert llm.last_step_num_scheduled_tokens == 0
    (prompt,) = random_prompts([40])
    llm.add_request("a", prompt, THREE)
    counts = []
    while llm.has_unfinished_requests():
        llm.step()
        counts.append(llm.last_step_num_scheduled_tokens)
    # A 32-token chunk, the 8 left (first token sampled), then one token per decode step.
    assert counts == [32, 8, 1, 1]
    llm.add_request("b", prompt, THREE)
    (out,) = llm.step()
    cached = out.num_cached_tokens
    assert cached > 0 and cached % 4 == 0  # whole blocks of the same prompt
    assert llm.last_step_num_scheduled_tokens == 40 - cached
    llm.add_request("c", random_prompts([5], seed=7)[0], THREE)
    llm.step()  # b decodes while c prefills: 1 + 5
    assert llm.last_step_num_scheduled_tokens == 1 + 5
    while llm.has_unfinished_requests():
        llm.step()
    llm.step()  # nothing to do
    assert llm.last_step_num_scheduled_tokens == 0


def test_tokenize_and_normalize_prompts_reject_bad_input() -> None:
    assert tokenize({"prompt_token_ids": [1, 2]}, tokenizer=None, model_name="m",
                    vocab_size=8) == (None, [1, 2])
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 8\)"):
        tokenize([1, 9], tokenizer=None, model_name="m", vocab_size=8)
    with pytest.raises(ValueError, match="has no tokenizer"):
        tokenize("hi", tokenizer=None, model_name="m", vocab_size=8)
    prompts, params = normalize_prompts([1, 2, 3], None)
    assert prompts == [[1, 2, 3]] and len(params) == 1
    with pytest.raises(ValueError, match="got 1 SamplingParams for 2 prompts"):
        normalize_prompts([[1], [2]], [THREE])


def test_make_children_names_and_seeds_each_sample() -> None:
    parent = ParentRequest("r", None, [1, 2, 3])
    arrivals = iter(range(10, 20))
    children = make_children(parent, SamplingParams(n=3, seed=5), arrivals=arrivals,
                             eos_token_ids=(), now=0.0)
    assert [c.request_id for c in children] == ["r#0", "r#1", "r#2"]
    assert [c.params.seed for c in children] == [5, 6, 7]
    assert [c.sample_index for c in children] == [0, 1, 2]
    assert parent.children == children
    (only,) = make_children(ParentRequest("s", None, [1]), SamplingParams(), arrivals=arrivals,
                            eos_token_ids=(), now=0.0)
    assert only.request_id == "s"
