"""On a CUDA device in bf16: the first greedy tokens agree with transformers and logits stay
close, with whichever backend the selector picks."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import ARCHS, random_prompts

from pagedcore import LLM, SamplingParams
from pagedcore.engine.models.loading import random_model, tiny_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_first_tokens_and_logits_close(arch: str) -> None:
    cuda = torch.device("cuda")
    config = tiny_config(arch, hidden_size=128, head_dim=64, num_attention_heads=4,
                         num_key_value_heads=2)
    ref = random_model(config, dtype=torch.bfloat16, device=cuda, seed=0)
    ref.set_attn_implementation("eager")
    eng = random_model(config, dtype=torch.bfloat16, device=cuda, seed=0)
    llm = LLM(eng, device="cuda", dtype="bfloat16", block_size=16, max_model_len=256,
              kv_cache_memory_bytes=64 << 20)
    prompts = random_prompts([7, 40, 100], seed=9)
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                                logprobs=1))
    for prompt, out in zip(prompts, outs, strict=True):
        hf = ref.generate(torch.tensor([prompt], device=cuda), max_new_tokens=4,
                          do_sample=False, eos_token_id=None, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True)
        expected = hf.sequences[0, len(prompt):].tolist()
        got = out.outputs[0].token_ids
        assert got[0] == expected[0], (arch, llm.backend_names, got, expected)
        first_lp = hf.logits[0][0].float().log_softmax(-1)
        assert out.outputs[0].logprobs is not None
        for token, value in out.outputs[0].logprobs[0].items():
            assert abs(value - float(first_lp[token])) < 0.15, (arch, token, value)
