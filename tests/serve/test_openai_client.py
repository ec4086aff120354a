"""The official `openai` client against a live server: outputs equal `LLM.generate`."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest
from serve_helpers import DEMO_KW, LiveServer

from pagedcore.engine.llm import LLM
from pagedcore.engine.sampling.sampling_params import SamplingParams

PROMPTS = ["Hello there", "What is a block table?", "Café 日本"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def demo_reference() -> list[Any]:
    llm = LLM("demo", device="cpu", **DEMO_KW)
    return [o.outputs[0] for o in
            llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))]


def _client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_completions_sync_and_streaming_equal_generate(demo_server: LiveServer,
                                                      demo_reference: list[Any]) -> None:
    client = _client(demo_server)
    for prompt, ref in zip(PROMPTS, demo_reference, strict=True):
        out = client.completions.create(model="m", prompt=prompt, max_tokens=MAX_TOKENS,
                                        temperature=0)
        assert out.choices[0].text == ref.text
        assert out.choices[0].finish_reason == ref.finish_reason
        assert out.usage is not None and out.usage.completion_tokens == len(ref.token_ids)
        chunks = list(client.completions.create(
            model="m", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == \
            ref.finish_reason
        assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == \
            len(demo_server.tokenizer.encode(prompt))


def test_batch_of_prompts_and_n_samples(demo_server: LiveServer,
                                        demo_reference: list[Any]) -> None:
    out = _client(demo_server).completions.create(model="m", prompt=PROMPTS[:2],
                                                  max_tokens=MAX_TOKENS, temperature=0, n=2)
    texts = {c.index: c.text for c in out.choices}
    assert texts == {0: demo_reference[0].text, 1: demo_reference[0].text,
                     2: demo_reference[1].text, 3: demo_reference[1].text}


def test_token_id_prompt_and_logprobs(demo_server: LiveServer,
                                      demo_reference: list[Any]) -> None:
    ids = demo_server.tokenizer.encode(PROMPTS[0])
    out = _client(demo_server).completions.create(model="m", prompt=ids, max_tokens=MAX_TOKENS,
                                                  temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert out.choices[0].text == demo_reference[0].text
    assert lp is not None and len(lp.token_logprobs or []) == len(demo_reference[0].token_ids)
    # Greedy: the sampled token is the most likely one.
    for top, sampled in zip(lp.top_logprobs or [], lp.token_logprobs or [], strict=True):
        assert max(top.values()) == pytest.approx(sampled)


def test_stop_string_cuts_the_text(demo_server: LiveServer, demo_reference: list[Any]) -> None:
    ref = demo_reference[1].text
    stop = ref[3:5]
    assert stop and ref.find(stop) >= 0
    out = _client(demo_server).completions.create(model="m", prompt=PROMPTS[1],
                                                  max_tokens=MAX_TOKENS, temperature=0,
                                                  stop=[stop])
    assert out.choices[0].text == ref[: ref.find(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_async_client_streaming_completions(demo_server: LiveServer,
                                            demo_reference: list[Any]) -> None:
    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=demo_server.url + "/v1", api_key="x",
                                    max_retries=0)

        async def one(prompt: str) -> str:
            stream = await client.completions.create(model="m", prompt=prompt,
                                                     max_tokens=MAX_TOKENS, temperature=0,
                                                     stream=True)
            return "".join([c.choices[0].text async for c in stream if c.choices])

        try:
            return list(await asyncio.gather(*(one(p) for p in PROMPTS)))
        finally:
            await client.close()

    assert asyncio.run(run()) == [r.text for r in demo_reference]


def test_chat_sync_async_streaming_equal_generate(chat_server: LiveServer) -> None:
    tok = chat_server.tokenizer
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Où est le café? 日本"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tok.encode(ids, add_special_tokens=False)
    assert prompt_ids.count(tok.bos_token_id) == 1  # no doubled BOS
    ref_llm = LLM(chat_server.model, device="cpu", max_model_len=256, backend="reference")
    ref = ref_llm.generate([prompt_ids], SamplingParams(max_tokens=12, temperature=0))[0]
    ref_text = tok.decode(ref.outputs[0].token_ids, skip_special_tokens=True)

    client = _client(chat_server)
    out = client.chat.completions.create(model="m", messages=messages,  # type: ignore[arg-type]
                                         max_tokens=12, temperature=0)
    assert out.choices[0].message.content == ref_text
    assert out.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert out.usage is not None and out.usage.prompt_tokens == len(prompt_ids)

    async def stream() -> tuple[str, str | None]:
        aclient = openai.AsyncOpenAI(base_url=chat_server.url + "/v1", api_key="x",
                                     max_retries=0)
        try:
            s = await aclient.chat.completions.create(
                model="m", messages=messages, max_tokens=12,  # type: ignore[arg-type]
                temperature=0, stream=True)
            chunks = [c async for c in s]
        finally:
            await aclient.close()
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        return text, chunks[-1].choices[0].finish_reason

    assert asyncio.run(stream()) == (ref_text, ref.outputs[0].finish_reason)


def test_chat_logprobs_and_stop(chat_server: LiveServer) -> None:
    client = _client(chat_server)
    messages = [{"role": "user", "content": "café"}]
    full = client.chat.completions.create(model="m", messages=messages,  # type: ignore[arg-type]
                                          max_tokens=10, temperature=0, logprobs=True,
                                          top_logprobs=3, extra_body={"ignore_eos": True})
    content = full.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == full.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs))
    text = full.choices[0].message.content or ""
    if len(text) >= 4:  # random weights: cut at a piece of what greedy decoding produced
        stop = text[2:4]
        cut = client.chat.completions.create(model="m", messages=messages,  # type: ignore[arg-type]
                                             max_tokens=10, temperature=0, stop=stop,
                                             extra_body={"ignore_eos": True})
        assert cut.choices[0].message.content == text[: text.find(stop)]
        assert cut.choices[0].finish_reason == "stop"


def test_the_engine_keeps_its_tokenizer_and_serve_uses_its_text(chat_server: LiveServer) -> None:
    """AsyncEngine no longer takes the tokenizer off the LLM: the engine detokenizes, matches
    the stop strings, and serves the same text as `LLM.generate` with the same params."""
    from pagedcore.engine.llm import LLM
    from pagedcore.engine.sampling.sampling_params import SamplingParams

    assert chat_server.llm.tokenizer is not None
    assert chat_server.engine.tokenizer is chat_server.llm.tokenizer
    client = _client(chat_server)
    out = client.completions.create(model="m", prompt="Hello world", max_tokens=12,
                                    temperature=0, extra_body={"ignore_eos": True,
                                                               "min_tokens": 3})
    ref = LLM(chat_server.model, device="cpu", backend="reference", max_model_len=256)
    [want] = ref.generate(["Hello world"], SamplingParams(max_tokens=12, temperature=0,
                                                          ignore_eos=True, min_tokens=3))
    assert out.choices[0].text == want.outputs[0].text


@pytest.fixture(scope="module")
def chat_reference(chat_server: LiveServer) -> LLM:
    """An engine of its own over the served checkpoint (the server's belongs to its thread)."""
    return LLM(chat_server.model, device="cpu", backend="reference", max_model_len=256)


def test_completions_prompt_logprobs_as_vllm_returns_them(chat_server: LiveServer,
                                                          chat_reference: LLM) -> None:
    tok = chat_server.tokenizer
    prompt = "Paged attention stores the KV cache"
    ids = tok.encode(prompt)
    want = chat_reference.generate([prompt], SamplingParams(
        max_tokens=2, temperature=0, prompt_logprobs=2))[0].prompt_logprobs
    assert want is not None
    # vLLM's extension field (`extra_body` in the openai client), on every choice.
    out = _client(chat_server).completions.create(
        model="m", prompt=prompt, max_tokens=2, temperature=0, n=2,
        extra_body={"prompt_logprobs": 2})
    for choice in out.choices:
        got = choice.model_extra["prompt_logprobs"]  # type: ignore[index]
        assert len(got) == len(ids) and got[0] is None
        for j in range(1, len(ids)):
            assert str(ids[j]) in got[j]
            assert got[j] == {str(t): {"logprob": pytest.approx(lp.logprob, abs=1e-5),
                                       "rank": lp.rank, "decoded_token": lp.decoded_token}
                              for t, lp in want[j].items()}  # type: ignore[union-attr]
    # Streaming: one chunk carries them; without the field no choice has them.
    chunks = list(_client(chat_server).completions.create(
        model="m", prompt=prompt, max_tokens=2, temperature=0, stream=True,
        extra_body={"prompt_logprobs": 2}))
    carried = [c.choices[0].model_extra.get("prompt_logprobs") for c in chunks if c.choices]
    assert [len(c) for c in carried if c is not None] == [len(ids)]
    plain = _client(chat_server).completions.create(model="m", prompt=prompt, max_tokens=2)
    assert "prompt_logprobs" not in (plain.choices[0].model_extra or {})


def test_chat_prompt_logprobs_at_the_top_as_vllm_has_them(chat_server: LiveServer,
                                                         chat_reference: LLM) -> None:
    messages = [{"role": "user", "content": "café"}]
    out = _client(chat_server).chat.completions.create(
        model="m", messages=messages, max_tokens=2, temperature=0,  # type: ignore[arg-type]
        extra_body={"prompt_logprobs": 1})
    got = (out.model_extra or {})["prompt_logprobs"]
    [want] = chat_reference.chat(messages, SamplingParams(max_tokens=2, temperature=0,
                                                          prompt_logprobs=1))
    assert want.prompt_logprobs is not None and len(got) == len(want.prompt_token_ids)
    assert got[0] is None and all(
        {int(t) for t in g} == set(w) for g, w in zip(got[1:], want.prompt_logprobs[1:],
                                                      strict=True))
