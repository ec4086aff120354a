"""Stopping as models expect: every EOS id, stop strings across tokens, min_tokens,
stop_reason, and sampling defaults from the checkpoint's generation_config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizer_helpers import CORPUS, EOS_IDS, make_chat_checkpoint

from pagedcore.engine.llm import LLM
from pagedcore.engine.sampling.sampling_params import SamplingParams

PROMPTS = [text[:n] for text in CORPUS[:5] for n in (6, 14, 23, 31)]
MAX_NEW = 24


def _hf_generate(model: Any, ids: list[int]) -> list[int]:
    """transformers' greedy tokens with the model's own stopping (its generation_config)."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False)
    return out[0, len(ids):].tolist()


def test_greedy_tokens_equal_transformers_with_every_eos_id(llm: LLM, hf_model: Any) -> None:
    assert set(EOS_IDS) <= set(llm.eos_token_ids)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    ends = []
    for prompt, out in zip(PROMPTS, outs, strict=True):
        expected = _hf_generate(hf_model, out.prompt_token_ids)
        got = out.outputs[0]
        assert got.token_ids == expected, prompt
        if got.finish_reason == "stop":
            assert got.stop_reason == got.token_ids[-1] and got.token_ids[-1] in EOS_IDS
            ends.append(got.token_ids[-1])
        else:
            assert got.finish_reason == "length" and got.stop_reason is None
    # Both ids really end sequences (with the first id alone, id 4 would run past the turn).
    assert 4 in ends and len(ends) < len(PROMPTS)


def _greedy_text(llm: LLM, prompt: str, **kw: Any) -> Any:
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, **kw)
    return llm.generate([prompt], params)[0].outputs[0]


def test_stop_strings_across_token_boundaries(llm: LLM) -> None:
    tok = llm.tokenizer
    prompt = PROMPTS[3]
    full = _greedy_text(llm, prompt)
    # A stop string that starts inside one token and ends inside a later one.
    pieces = [tok.decode([t]) for t in full.token_ids]
    starts = [len("".join(pieces[:i])) for i in range(len(pieces) + 1)]
    k = next(i for i in range(2, len(pieces) - 1) if len(pieces[i]) >= 2 and pieces[i + 1])
    lo, hi = starts[k] + 1, starts[k + 1] + 1  # from the middle of token k into token k+1
    stop = full.text[lo:hi + 1]
    assert all(stop not in p for p in pieces)  # no single token holds it
    first = full.text.find(stop)
    cut = _greedy_text(llm, prompt, stop=[stop, "never-in-text"])
    assert cut.text == full.text[:first]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    # The request stopped at once: it kept only the tokens up to the one completing the match.
    assert full.token_ids[: len(cut.token_ids)] == cut.token_ids
    assert len(cut.token_ids) < len(full.token_ids)
    assert len(tok.decode(cut.token_ids)) >= first + len(stop)
    kept = _greedy_text(llm, prompt, stop=[stop], include_stop_str_in_output=True)
    assert kept.text == full.text[: first + len(stop)]
    assert kept.token_ids == cut.token_ids


def test_min_tokens_holds_eos_and_stop_tokens_back(llm: LLM) -> None:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    early = next(o for o in outs if o.outputs[0].finish_reason == "stop"
                 and len(o.outputs[0].token_ids) < MAX_NEW - 4)
    n = len(early.outputs[0].token_ids)
    [held] = llm.generate([early.prompt_token_ids],
                          SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=n + 2))
    got = held.outputs[0].token_ids
    assert len(got) >= n + 2
    assert not set(got[: n + 2]) & set(EOS_IDS)  # masked while below min_tokens
    assert got[: n - 1] == early.outputs[0].token_ids[: n - 1]


def test_text_skips_special_tokens_unless_asked(llm: LLM) -> None:
    tok = llm.tokenizer
    prompt = [tok.bos_token_id, *tok.encode("Hello world", add_special_tokens=False)]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                                logit_bias={4: 100.0}, min_tokens=2))
    ids = out[0].outputs[0].token_ids
    assert ids[-1] == 4
    # (The bytes of the character the sequence ends inside never print: decode's text, less
    # its last replacement character; one before it stands for an invalid byte and stays.)
    full = tok.decode(ids, skip_special_tokens=True)
    assert out[0].outputs[0].text == (full[:-1] if full.endswith("\ufffd") else full)
    assert "<|end|>" not in out[0].outputs[0].text
    raw = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                                logit_bias={4: 100.0}, min_tokens=2,
                                                skip_special_tokens=False))
    assert raw[0].outputs[0].text.endswith("<|end|>")


def test_defaults_come_from_generation_config(tmp_path: Path) -> None:
    path = make_chat_checkpoint(tmp_path / "ckpt", multi_eos=True,
                                generation={"do_sample": True, "temperature": 0.6,
                                            "top_p": 0.9, "max_new_tokens": 5})
    llm = LLM(str(path), device="cpu", backend="reference", max_model_len=64,
              kv_cache_memory_bytes=4 * 2**20)
    assert llm.sampling_defaults == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 5}
    params = llm.default_sampling_params()
    assert (params.temperature, params.top_p, params.max_tokens) == (0.6, 0.9, 5)
    [out] = llm.generate(["Hello"])
    assert out.sampling_defaults == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 5}
    assert len(out.outputs[0].token_ids) <= 5
    # Given params are used as they are (and the metadata says nothing was defaulted).
    [given] = llm.generate(["Hello"], SamplingParams(max_tokens=7, ignore_eos=True))
    assert given.sampling_defaults == {} and len(given.outputs[0].token_ids) == 7


def test_max_tokens_none_runs_to_max_model_len(llm: LLM) -> None:
    prompt = llm.tokenizer.encode(PROMPTS[0])
    [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=None,
                                                  ignore_eos=True))
    assert len(out.outputs[0].token_ids) == llm.max_model_len - len(prompt)
    assert out.outputs[0].finish_reason == "length"


def test_stop_strings_without_a_tokenizer_are_refused() -> None:
    llm = LLM("random:llama", device="cpu", backend="reference", max_model_len=64,
              kv_cache_memory_bytes=4 * 2**20)
    with pytest.raises(ValueError, match="stop needs a tokenizer"):
        llm.generate([[1, 2, 3]], SamplingParams(stop=["x"]))


def test_stop_strings_end_each_sample_alone(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=MAX_NEW, ignore_eos=True)
    [free] = llm.generate([PROMPTS[2]], params)
    texts = [c.text for c in free.outputs]
    stop = next(t[4:6] for t in texts if len(t) > 8 and t[4:6].strip())
    [cut] = llm.generate([PROMPTS[2]], params.replace(stop=[stop]))
    for before, after in zip(free.outputs, cut.outputs, strict=True):
        if stop in before.text:
            assert after.text == before.text[: before.text.find(stop)]
            assert (after.finish_reason, after.stop_reason) == ("stop", stop)
        else:
            assert after.token_ids == before.token_ids and after.finish_reason == "length"
    assert llm.kv_cache_manager.usage == 0.0


@pytest.mark.parametrize("kind", ["stop", "penalties"])
def test_overlap_scheduling_gives_the_same_outputs(multi_eos_checkpoint: Path,
                                                   kind: str) -> None:
    """Stop strings (checked one step behind) and logits processors (which need every token:
    those steps run without overlap) under ``async_scheduling=True``."""
    base = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
    runs = []
    for overlap in (False, True):
        llm = LLM(str(multi_eos_checkpoint), device="cpu", backend="reference",
                  max_model_len=128, kv_cache_memory_bytes=8 * 2**20,
                  async_scheduling=overlap)
        assert llm.async_scheduling is overlap
        if kind == "stop":
            full = llm.generate(PROMPTS[:6], base)
            params = [base.replace(stop=[o.outputs[0].text[5:7]]) for o in full]
        else:
            params = [base.replace(repetition_penalty=1.4, presence_penalty=0.5, min_tokens=3,
                                   logit_bias={9: 2.0})] * 6
        outs = llm.generate(PROMPTS[:6], params)
        runs.append([(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].stop_reason,
                      [{t: lp.rank for t, lp in e.items()} for e in o.outputs[0].logprobs or []],
                      [lp for e in o.outputs[0].logprobs or [] for lp in e.values()])
                     for o in outs])
        assert llm.kv_cache_manager.usage == 0.0
    assert [r[:4] for r in runs[0]] == [r[:4] for r in runs[1]]
    for a, b in zip(runs[0], runs[1], strict=True):
        assert a[4] == pytest.approx(b[4], abs=1e-5)
    if kind == "stop":
        assert any(run[2] is not None for run in runs[0])
