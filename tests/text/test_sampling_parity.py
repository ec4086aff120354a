"""Sampling parity with vLLM: penalties (against a direct torch computation and transformers),
logit_bias, bad_words, allowed_token_ids, Logprob objects, top_k=0, validation."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch
from device_helpers import TEST_DEVICE, require_test_device
from tokenizer_helpers import CORPUS

from pagedcore.engine.llm import LLM
from pagedcore.engine.sampling.logits_processors import apply_logits_processors
from pagedcore.engine.sampling.sampling_params import SamplingParams
from pagedcore.engine.validation import InvalidArgumentTypeError


@attrs.define
class _Seq:
    all_token_ids: list[int]
    num_prompt_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    bad_words_token_ids: list[list[int]] = attrs.Factory(list)


def _direct(logits: torch.Tensor, seq: _Seq, p: SamplingParams) -> torch.Tensor:
    """One row, token by token: vLLM's definitions written out."""
    row = logits.clone()
    prompt = seq.all_token_ids[: seq.num_prompt_tokens]
    output = seq.all_token_ids[seq.num_prompt_tokens:]
    for token in set(prompt) | set(output):
        value = row[token]
        row[token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
    for token in set(output):
        row[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    return row


def test_penalties_match_a_direct_computation() -> None:
    require_test_device()
    g = torch.Generator().manual_seed(0)
    vocab, rows = 50, 6
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(TEST_DEVICE)
    seqs, params = [], []
    for i in range(rows):
        ids = torch.randint(0, vocab, (12 + i,), generator=g).tolist()
        seqs.append(_Seq(ids, num_prompt_tokens=5))
        params.append(SamplingParams(presence_penalty=0.5 * (i % 3), frequency_penalty=0.3 * i,
                                     repetition_penalty=1.0 + 0.2 * (i % 2)))
    got = apply_logits_processors(logits, params, seqs)
    assert got.device == logits.device
    want = torch.stack([_direct(logits[i], seqs[i], params[i]) for i in range(rows)])
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 1e-6, rel
    assert not torch.equal(got, logits)


def test_bias_masks_and_bad_words_on_the_batch() -> None:
    require_test_device()
    logits = torch.zeros(4, 10, device=TEST_DEVICE)
    seqs = [_Seq([1, 2, 3], 1), _Seq([1, 7, 8], 1, bad_words_token_ids=[[8, 9], [5]]),
            _Seq([1], 1, eos_token_ids=frozenset({2})), _Seq([1, 3], 1)]
    params = [SamplingParams(logit_bias={4: 2.5, 0: -1.0}),
              SamplingParams(bad_words=("x",)),
              SamplingParams(min_tokens=2, stop_token_ids=(6,)),
              SamplingParams(allowed_token_ids=(3, 5))]
    out = apply_logits_processors(logits, params, seqs)
    assert out[0, 4] == 2.5 and out[0, 0] == -1.0 and out[0, 1] == 0
    assert out[1, 9] == float("-inf") and out[1, 5] == float("-inf") and out[1, 8] == 0
    assert out[2, 2] == float("-inf") and out[2, 6] == float("-inf") and out[2, 3] == 0
    assert torch.isfinite(out[3]).tolist() == [t in (3, 5) for t in range(10)]


def test_repetition_penalty_equals_transformers(llm: LLM, hf_model: Any) -> None:
    prompts = [llm.tokenizer.encode(text[:20]) for text in CORPUS[:3]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                            repetition_penalty=1.5)
    outs = llm.generate(prompts, params)
    plain = llm.generate(prompts, params.replace(repetition_penalty=1.0))
    for ids, out in zip(prompts, outs, strict=True):
        ref = hf_model.generate(torch.tensor([ids], device=TEST_DEVICE), max_new_tokens=16,
                                do_sample=False, repetition_penalty=1.5, eos_token_id=None)
        assert out.outputs[0].token_ids == ref[0, len(ids):].tolist()
    assert [o.outputs[0].token_ids for o in outs] != [o.outputs[0].token_ids for o in plain]


def test_engine_applies_bias_allowed_ids_and_bad_words(llm: LLM) -> None:
    tok = llm.tokenizer
    prompt = tok.encode("Hello world")
    base = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    [biased] = llm.generate([prompt], base.replace(logit_bias={100: 100.0}))
    assert biased.outputs[0].token_ids == [100] * 8
    # Two whole-word tokens (each re-encodes to itself alone).
    words = [t for t in range(len(tok)) if tok.decode([t]).isalpha()
             and tok.encode(tok.decode([t]), add_special_tokens=False) == [t]][:2]
    [allowed] = llm.generate([prompt], base.replace(allowed_token_ids=tuple(words)))
    got = allowed.outputs[0].token_ids
    assert set(got) <= set(words)
    first = got[0]
    [banned] = llm.generate([prompt], base.replace(allowed_token_ids=tuple(words),
                                                   bad_words=(tok.decode([first]),)))
    assert first not in banned.outputs[0].token_ids
    assert set(banned.outputs[0].token_ids) == set(words) - {first}


def test_logprobs_are_objects_with_rank_and_text(llm: LLM, hf_model: Any) -> None:
    tok = llm.tokenizer
    prompt = tok.encode(CORPUS[0][:24])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    [out] = llm.generate([prompt], params)
    comp = out.outputs[0]
    ref = hf_model.generate(torch.tensor([prompt], device=TEST_DEVICE), max_new_tokens=6,
                            do_sample=False, eos_token_id=None, output_logits=True,
                            return_dict_in_generate=True)
    ref_lp = torch.stack([x[0] for x in ref.logits]).log_softmax(-1).cpu()
    assert comp.logprobs is not None and len(comp.logprobs) == 6
    total = 0.0
    for step, (token, entry) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
        assert len(entry) == 3 and entry[token].rank == 1  # greedy: the top token
        assert [e.rank for e in entry.values()] == [1, 2, 3]
        for t, e in entry.items():
            assert abs(e.logprob - float(ref_lp[step, t])) < 1e-4
            assert e.decoded_token == tok.decode([t])
        total += entry[token].logprob
    assert comp.cumulative_logprob == pytest.approx(total)
    # A sampled token outside the top ones keeps its true rank.
    [low] = llm.generate([prompt], params.replace(logprobs=0, logit_bias={7: 100.0}))
    first = low.outputs[0].logprobs[0][7]  # type: ignore[index]
    assert first.rank == 1 + int((ref_lp[0] > ref_lp[0, 7]).sum())


def test_top_k_zero_means_all_tokens(llm: LLM) -> None:
    prompt = llm.tokenizer.encode("Hello")
    seeded = SamplingParams(temperature=1.0, max_tokens=10, seed=3, ignore_eos=True)
    runs = [llm.generate([prompt], seeded.replace(top_k=k))[0].outputs[0].token_ids
            for k in (None, 0, -1, 2)]
    assert runs[0] == runs[1] == runs[2] != runs[3]


def test_validation_names_every_bad_field_at_once() -> None:
    with pytest.raises(InvalidArgumentTypeError) as info:
        SamplingParams(temperature="0.5", presence_penalty=3.0,  # type: ignore[arg-type]
                       repetition_penalty=0, logit_bias={"x": 1.0}, stop=[1],  # type: ignore
                       min_tokens=5, max_tokens=2, allowed_token_ids=[])
    message = str(info.value)
    for field in ("temperature", "presence_penalty", "repetition_penalty", "logit_bias",
                  "stop", "min_tokens", "allowed_token_ids"):
        assert field in message, field
