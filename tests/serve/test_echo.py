"""``echo`` on /v1/completions through the official `openai` client: the prompt's text and
logprobs lead each choice, streamed or not; ``max_tokens: 0`` scores the prompt alone (what
evaluation harnesses send for log-likelihoods)."""

from __future__ import annotations

import math
from typing import Any

import openai
import pytest
from serve_helpers import LiveServer

PROMPT = "What is a block table?"


def _client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _prompt_logprobs(server: LiveServer, prompt: Any) -> tuple[list[float], list[float]]:
    """Each prompt token's logprob after the first, and the best logprob at its position,
    from vLLM's ``prompt_logprobs``."""
    out = _client(server).completions.create(
        model="m", prompt=prompt, max_tokens=1, temperature=0,
        extra_body={"prompt_logprobs": 1})
    entries = out.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
    ids = server.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    assert entries[0] is None and len(entries) == len(ids)
    own = [e[str(t)]["logprob"] for e, t in zip(entries[1:], ids[1:], strict=True)]
    best = [max(v["logprob"] for v in e.values()) for e in entries[1:]]
    return own, best


def _close(a: list[Any], b: list[float]) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, abs_tol=1e-5)
                                    for x, y in zip(a, b, strict=True))


def test_echo_leads_with_the_prompt_and_its_logprobs(demo_server: LiveServer) -> None:
    client = _client(demo_server)
    ids = demo_server.tokenizer.encode(PROMPT)
    plain = client.completions.create(model="m", prompt=PROMPT, max_tokens=4, temperature=0,
                                      logprobs=2)
    echoed = client.completions.create(model="m", prompt=PROMPT, max_tokens=4, temperature=0,
                                       logprobs=2, echo=True)
    [p], [e] = plain.choices, echoed.choices
    assert e.text == PROMPT + p.text and e.finish_reason == p.finish_reason
    lp, plp = e.logprobs, p.logprobs
    assert lp is not None and plp is not None
    n = len(ids)
    assert lp.tokens == [demo_server.tokenizer.decode([t]) for t in ids] + plp.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts it
    own, best = _prompt_logprobs(demo_server, PROMPT)
    assert _close(lp.token_logprobs[1:n], own)
    # Top entries are keyed by text (byte pieces of this tokenizer may share one).
    assert _close([max(top.values()) for top in lp.top_logprobs[1:n]], best)
    # The top 2 and the chosen token (up to 3 entries, as OpenAI documents).
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs[1:])
    assert all(top[tok] >= logprob - 1e-6 for top, tok, logprob in zip(
        lp.top_logprobs[1:], lp.tokens[1:], lp.token_logprobs[1:], strict=True))
    assert lp.text_offset == sorted(lp.text_offset)
    assert _close(lp.token_logprobs[n:], plp.token_logprobs)
    # Offsets run through the prompt, then the completion from the prompt's end.
    assert lp.text_offset[0] == 0 and lp.text_offset[n] == len(PROMPT)
    assert lp.text_offset[n:] == [o + len(PROMPT) for o in plp.text_offset]
    assert echoed.usage is not None and echoed.usage.completion_tokens == 4


def test_echo_with_max_tokens_zero_scores_the_prompt_alone(demo_server: LiveServer) -> None:
    client = _client(demo_server)
    ids = demo_server.tokenizer.encode(PROMPT)
    out = client.completions.create(model="m", prompt=ids, max_tokens=0, logprobs=1,
                                    echo=True)
    [c] = out.choices
    assert c.text == demo_server.tokenizer.decode(ids)  # token ids come back as text
    assert c.finish_reason == "length" and c.logprobs is not None
    assert len(c.logprobs.tokens) == len(ids)
    assert _close(c.logprobs.token_logprobs[1:], _prompt_logprobs(demo_server, ids)[0])
    assert out.usage is not None and out.usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError, match="0 only with echo"):
        client.completions.create(model="m", prompt=PROMPT, max_tokens=0)


def test_echo_scoring_reports_no_completion_whatever_the_hidden_token(
        demo_server: LiveServer) -> None:
    """The one token the engine samples for ``max_tokens: 0`` is not part of the answer:
    ``finish_reason`` stays ``"length"`` and ``completion_tokens`` 0 even when that token is
    EOS (vLLM would report ``"stop"`` and 1 here; docs/serving.md says why we do not)."""
    client = _client(demo_server)
    eos = demo_server.tokenizer.eos_token_id
    kw: dict[str, Any] = dict(model="m", prompt=PROMPT, max_tokens=0, echo=True,
                              extra_body={"allowed_token_ids": [eos]})
    out = client.completions.create(**kw)
    [c] = out.choices
    assert (c.text, c.finish_reason, c.model_extra["stop_reason"]) == (  # type: ignore[index]
        PROMPT, "length", None)
    assert out.usage is not None and out.usage.completion_tokens == 0
    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    assert [c.finish_reason for ch in chunks for c in ch.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 0


@pytest.mark.parametrize("max_tokens", [0, 5])
def test_streamed_echo_equals_the_response(demo_server: LiveServer, max_tokens: int) -> None:
    client = _client(demo_server)
    kw: dict[str, Any] = dict(model="m", prompt=[PROMPT, "Hello"], max_tokens=max_tokens,
                              temperature=0, echo=True, logprobs=1, n=2)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    tokens: dict[int, list[Any]] = {}
    firsts: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            firsts.setdefault(c.index, c.text)
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.logprobs is not None:
                tokens.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
    assert {c.index: c.text for c in whole.choices} == texts
    assert firsts == {0: PROMPT, 1: PROMPT, 2: "Hello", 3: "Hello"}
    for c in whole.choices:
        assert c.logprobs is not None and tokens[c.index] == c.logprobs.token_logprobs
    assert chunks[-1].usage is not None and whole.usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens \
        == 4 * max_tokens


def test_streamed_text_offsets_equal_the_response_and_top_logprobs_hold_the_token(
        chat_server: LiveServer) -> None:
    """Offsets count token texts in both forms (they used to follow each chunk's text in a
    stream, and went backwards where a chunk's token texts do not add up to its text: a
    skipped special token, pieces of a character); ``logprobs: 0`` still lists the chosen
    token in ``top_logprobs``, as OpenAI documents."""
    client = _client(chat_server)
    for prompt in ([5, 6, 7], "Hello there", [9, 3, 2, 11]):
        kw: dict[str, Any] = dict(model="m", prompt=prompt, max_tokens=8, temperature=0,
                                  logprobs=0)
        whole = client.completions.create(**kw).choices[0].logprobs
        offsets: list[int] = []
        for chunk in client.completions.create(**kw, stream=True):
            for c in chunk.choices:
                if c.logprobs is not None:
                    offsets.extend(c.logprobs.text_offset)
        assert whole is not None and offsets == whole.text_offset
        assert offsets == sorted(offsets)
        assert [list(top) for top in whole.top_logprobs] == [[t] for t in whole.tokens]
