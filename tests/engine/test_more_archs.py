"""Issue #25 item 5: the architectures beyond the first seven are token-identical to
transformers' generate() (float32, CPU, chunked prefill) with matching log-probabilities; ones
that cannot work are refused with the reason, not an allowlist."""

from __future__ import annotations

import copy

import pytest
import torch
from engine_helpers import CPU, hf_greedy, random_prompts

from pagedcore import LLM, SamplingParams
from pagedcore.engine.models.loading import random_model, tiny_config
from pagedcore.engine.models.support import UnsupportedModelError, architecture_problems

MORE_ARCHS = ["phi3", "olmo2", "granite", "qwen3_moe", "gemma", "starcoder2", "cohere"]
MAX_NEW = 8


def _installed(model_type: str) -> bool:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return model_type in CONFIG_MAPPING_NAMES


@pytest.mark.parametrize("arch", MORE_ARCHS)
def test_greedy_tokens_and_logprobs_match_transformers(arch: str) -> None:
    if not _installed(arch):
        pytest.skip(f"the installed transformers has no {arch!r}")
    config = tiny_config(arch)
    ref = random_model(copy.deepcopy(config), dtype=torch.float32, device=CPU)
    ref.set_attn_implementation("eager")
    eng = random_model(copy.deepcopy(config), dtype=torch.float32, device=CPU)
    llm = LLM(eng, device="cpu", block_size=4, max_model_len=64, max_num_batched_tokens=16,
              long_prefill_token_threshold=8, kv_cache_memory_bytes=1 << 20)
    prompts = random_prompts([5, 19])
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0,
                                                ignore_eos=True, logprobs=2))
    for prompt, out in zip(prompts, outs, strict=True):
        tokens, logprobs = hf_greedy(ref, prompt, MAX_NEW)
        assert out.outputs[0].token_ids == tokens, f"{arch}: {len(prompt)}-token prompt"
        assert out.outputs[0].logprobs is not None
        for step, entry in enumerate(out.outputs[0].logprobs):
            for token, value in entry.items():
                assert abs(value - float(logprobs[step, token])) < 1e-4, (arch, step, token)


def test_gpt2_layout_is_refused_with_the_reason() -> None:
    from transformers import GPT2Config

    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    problems = architecture_problems(config)
    assert len(problems) == 1 and "GPT-2" in problems[0] and "transformer.h" in problems[0]
    with pytest.raises(UnsupportedModelError, match="cannot run on the pagedcore engine"):
        LLM(config, device="cpu", max_model_len=32)


def test_attention_outside_the_interface_is_refused() -> None:
    if not _installed("bloom"):
        pytest.skip("the installed transformers has no 'bloom'")
    from transformers import BloomConfig

    (problem,) = architecture_problems(BloomConfig(n_layer=1, hidden_size=32, n_head=2))
    assert "does not go through transformers' AttentionInterface" in problem


def test_encoder_decoder_is_refused() -> None:
    from transformers import T5Config

    (problem,) = architecture_problems(T5Config(num_layers=1, d_model=32))
    assert "encoder-decoder" in problem


def test_a_layer_that_drops_the_attention_kwargs_is_refused() -> None:
    """Nemotron's decoder layer calls self_attn without passing **kwargs on: the engine's step
    state would never reach the attention, so every step would fail. Refused up front."""
    if not _installed("nemotron"):
        pytest.skip("the installed transformers has no 'nemotron'")
    from transformers import NemotronConfig

    config = NemotronConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                            num_attention_heads=2, num_key_value_heads=2, vocab_size=64)
    (problem,) = architecture_problems(config)
    assert "without passing its keyword arguments on" in problem
    with pytest.raises(UnsupportedModelError, match="NemotronDecoderLayer"):
        LLM(config, device="cpu")


def test_layers_outside_the_declared_base_model_are_named_where_they_are() -> None:
    """Llama4ForCausalLM keeps its layers at model.layers but declares 'language_model' as
    its base model: the refusal says so (not "laid out as GPT-2")."""
    if not _installed("llama4_text"):
        pytest.skip("the installed transformers has no 'llama4_text'")
    from transformers import AutoConfig

    config = AutoConfig.for_model("llama4_text", num_hidden_layers=1, hidden_size=32,
                                  intermediate_size=64, intermediate_size_mlp=64,
                                  num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                                  vocab_size=64)
    (problem,) = architecture_problems(config)
    assert "keeps its decoder layers at 'model.layers'" in problem and "GPT-2" not in problem
