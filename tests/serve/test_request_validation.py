"""Where vLLM's OpenAI server refuses a request, through the official `openai` client (raw
HTTP where the client would not send the body): ``stream_options`` without ``stream``,
``max_tokens`` past the model length, malformed union fields, and ``/tokenizer_info``."""

from __future__ import annotations

import httpx
import openai
import pytest
from serve_helpers import LiveServer

MESSAGES = [{"role": "user", "content": "Hi!"}]


def _client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_stream_options_without_stream_is_refused(chat_server: LiveServer) -> None:
    client = _client(chat_server)
    for create, kw in [(client.completions.create, {"prompt": "Hello"}),
                       (client.chat.completions.create, {"messages": MESSAGES})]:
        with pytest.raises(openai.BadRequestError, match="stream: true") as info:
            create(model="m", max_tokens=2, stream_options={"include_usage": True},
                   **kw)  # type: ignore[operator]
        assert (info.value.param, info.value.code) == ("stream_options", "invalid_value")
        # With stream: true it is what it was for.
        chunks = list(create(model="m", max_tokens=2, stream=True,  # type: ignore[operator]
                             stream_options={"include_usage": True}, **kw))
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


def test_max_tokens_past_the_model_length_is_refused(chat_server: LiveServer) -> None:
    """vLLM refuses a request whose prompt and ``max_tokens`` together pass the model
    length (it used to be cut short at the model length here, with ``finish_reason:
    "length"``)."""
    client = _client(chat_server)
    prompt = [5] * 252  # max_model_len 256: 4 tokens left
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="m", prompt=prompt, max_tokens=5)
    assert (info.value.param, info.value.code) == ("max_tokens", "context_length_exceeded")
    assert all(str(n) in info.value.message for n in (5, 256, 252, 4))
    out = client.completions.create(model="m", prompt=prompt, max_tokens=4,
                                    extra_body={"ignore_eos": True})
    assert out.usage is not None and out.usage.completion_tokens == 4
    # A prompt of the whole model length still gets its one token (the last token sampled
    # needs no KV slot), as when max_tokens is left out.
    whole = client.completions.create(model="m", prompt=[5] * 256, max_tokens=1)
    assert whole.usage is not None and whole.usage.completion_tokens == 1
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=MESSAGES,  # type: ignore[arg-type]
                                       max_completion_tokens=10**6)
    assert info.value.param == "max_completion_tokens"
    assert "256" in info.value.message
    # The server keeps serving.
    assert client.completions.create(model="m", prompt="Hi", max_tokens=1).choices


@pytest.mark.parametrize("body,field,said", [
    ({"prompt": [1.5]}, "prompt", "a list of token ids"),  # no member's shape: what it takes
    ({"prompt": None}, "prompt", "a list of strings"),
    ({"prompt": [[1, "a"]]}, "prompt.0.1", "valid integer"),  # a list of lists, one bad id
    ({"prompt": "a", "stop": [1]}, "stop.0", "valid string"),
], ids=["float-ids", "null", "bad-id-in-a-list", "stop-not-strings"])
def test_union_fields_say_what_they_accept(demo_server: LiveServer, body: dict[str, object],
                                           field: str, said: str) -> None:
    """Not pydantic's per-member errors (``'prompt.str': Input should be a valid string`` for
    a list of floats): the field as the user wrote it, and what it accepts."""
    r = httpx.post(demo_server.url + "/v1/completions", json={"model": "m", **body})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert f"invalid field {field!r}" in message and said in message, message
    assert ".str" not in message and "list[" not in message


def test_tokenizer_info_behind_its_flag(chat_server: LiveServer,
                                       demo_server: LiveServer) -> None:
    """vLLM's ``GET /tokenizer_info`` (``--enable-tokenizer-info-endpoint``): the tokenizer's
    ``tokenizer_config.json`` fields as JSON, without file paths, and its class."""
    tok = chat_server.tokenizer
    info = httpx.get(chat_server.url + "/tokenizer_info").json()
    assert info["tokenizer_class"] == type(tok).__name__
    assert info["eos_token"] == tok.eos_token  # a special token as its text
    assert not {"vocab_file", "merges_file", "tokenizer_file"} & set(info)
    assert httpx.get(demo_server.url + "/tokenizer_info").status_code == 404  # flag off
