"""Phi-3 ``longrope``: transformers picks short or long factors per forward call from its
largest position; the engine pins the choice from ``max_model_len`` (`pin_longrope`), so a
request's output does not depend on the requests sharing its step or on its chunking."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from pagedcore import LLM, SamplingParams
from pagedcore.engine.models.rope import pin_longrope

ORIGINAL = 32
NEW_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def phi3() -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "phi3", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False, partial_rotary_factor=0.5,
        original_max_position_embeddings=ORIGINAL,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": [1.0] * 4, "long_factor": [4.0, 8.0, 16.0, 32.0]})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.set_attn_implementation("eager")
    return model


@torch.no_grad()
def _transformers(model: Any, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and log-softmaxes, each from a full forward (no cache)."""
    seq, logprobs = list(prompt), []
    for _ in range(NEW_TOKENS):
        lp = model(torch.tensor([seq]), use_cache=False).logits[0, -1].log_softmax(-1)
        logprobs.append(lp)
        seq.append(int(lp.argmax()))
    return seq[len(prompt):], logprobs


def _engine(model: Any, prompts: list[list[int]], max_model_len: int, **kw: Any) -> list[Any]:
    llm = LLM(copy.deepcopy(model), device="cpu", dtype=torch.float32, block_size=4,
              max_model_len=max_model_len, **kw)
    return [o.outputs[0] for o in llm.generate(prompts, GREEDY)]


def _matches(out: Any, want: tuple[list[int], list[torch.Tensor]]) -> None:
    tokens, logprobs = want
    assert out.token_ids == tokens
    err = max(abs(entry[t].logprob - float(lp[t]))
              for entry, t, lp in zip(out.logprobs, out.token_ids, logprobs, strict=True))
    assert err < 1e-4


def _prompts() -> tuple[list[int], list[int]]:
    gen = torch.Generator().manual_seed(1)
    return (torch.randint(3, 128, (8,), generator=gen).tolist(),
            torch.randint(3, 128, (40,), generator=gen).tolist())


def test_within_the_original_length_every_request_gets_the_short_factors(phi3: Any) -> None:
    short, _ = _prompts()
    other = short[:5] + short
    outs = _engine(phi3, [short, other], max_model_len=ORIGINAL)
    _matches(outs[0], _transformers(phi3, short))  # (8 + 6 tokens: transformers' short set)
    _matches(outs[1], _transformers(phi3, other))


def test_past_it_the_long_factors_whatever_shares_the_step_or_the_chunking(phi3: Any) -> None:
    short, long = _prompts()
    pinned = copy.deepcopy(phi3)
    assert set(pin_longrope(pinned, 96).values()) == {"long"}
    want_short = _transformers(pinned, short)  # transformers with the long set, throughout
    alone = _engine(phi3, [short], max_model_len=96)[0]
    batched = _engine(phi3, [short, long], max_model_len=96)
    chunked = _engine(phi3, [long], max_model_len=96, max_num_batched_tokens=8)[0]
    _matches(alone, want_short)
    _matches(batched[0], want_short)  # not switched by the long request beside it
    want_long = _transformers(phi3, long)  # 40 > 32 tokens: transformers' long set too
    _matches(batched[1], want_long)
    _matches(chunked, want_long)  # its first chunks (positions < 32) rotated alike
