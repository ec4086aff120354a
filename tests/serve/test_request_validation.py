"""Where vLLM's OpenAI server refuses a request, through the official `openai` client (raw
HTTP where the client would not send the body), and vLLM's ``/tokenizer_info``."""

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
