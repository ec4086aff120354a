"""Bad input gets OpenAI-style error JSON with the right status, and the server keeps serving."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from serve_helpers import LiveServer

OK = {"model": "m", "prompt": "hi", "max_tokens": 2}

CASES: list[tuple[str, str, Any, int, str | None]] = [
    # (name, path, body (bytes: sent raw), status, param)
    ("malformed-json", "/v1/completions", b'{"model": "m", "prompt": ', 400, None),
    ("not-an-object", "/v1/completions", b"[1, 2]", 400, None),
    ("wrong-type-temperature", "/v1/completions", {**OK, "temperature": "0.5"}, 400,
     "temperature"),
    ("wrong-type-max-tokens", "/v1/completions", {**OK, "max_tokens": "ten"}, 400,
     "max_tokens"),
    ("missing-prompt", "/v1/completions", {"model": "m"}, 400, "prompt"),
    ("unknown-model", "/v1/completions", {**OK, "model": "gpt-17"}, 404, "model"),
    ("prompt-too-long", "/v1/completions", {**OK, "prompt": "x" * 300}, 400, "prompt"),
    ("max-tokens-zero", "/v1/completions", {**OK, "max_tokens": 0}, 400, "max_tokens"),
    ("max-tokens-negative", "/v1/completions", {**OK, "max_tokens": -3}, 400, "max_tokens"),
    ("n-too-large", "/v1/completions", {**OK, "n": 1000}, 400, "n"),
    ("negative-temperature", "/v1/completions", {**OK, "temperature": -1}, 400, "temperature"),
    ("top-p-zero", "/v1/completions", {**OK, "top_p": 0}, 400, "top_p"),
    ("top-p-above-one", "/v1/completions", {**OK, "top_p": 1.5}, 400, "top_p"),
    ("token-id-out-of-vocab", "/v1/completions", {**OK, "prompt": [1, 99999]}, 400, "prompt"),
    ("unsupported-suffix", "/v1/completions", {**OK, "suffix": "!"}, 400, "suffix"),
    ("prompt-logprobs-too-many", "/v1/completions", {**OK, "prompt_logprobs": 21}, 400,
     "prompt_logprobs"),
    ("prompt-logprobs-wrong-type", "/v1/completions", {**OK, "prompt_logprobs": "2"}, 400,
     "prompt_logprobs"),
    ("empty-messages", "/v1/chat/completions", {"model": "m", "messages": []}, 400,
     "messages"),
    ("no-chat-template", "/v1/chat/completions",
     {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, 400, "messages"),
    ("bad-role", "/v1/chat/completions",
     {"model": "m", "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("no-route", "/v1/embeddings", OK, 404, None),
    # Past json's recursion limit: a 400, not the RecursionError's 500.
    ("deeply-nested-json", "/v1/completions",
     b'{"model": "m", "prompt": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),
    ("lone-surrogate", "/v1/completions", b'{"model": "m", "prompt": "\\ud800"}', 400, None),
    # Out-of-range values SamplingParams catches name their field too.
    ("seed-negative", "/v1/completions", {**OK, "seed": -1}, 400, "seed"),
    ("penalty-out-of-range", "/v1/completions", {**OK, "presence_penalty": 3.0}, 400,
     "presence_penalty"),
    ("logit-bias-superscript-key", "/v1/completions", {**OK, "logit_bias": {"\u00b2": 1}}, 400,
     "logit_bias"),
    # Token ids the model does not have: refused, not sampled as "every logit -inf".
    ("allowed-token-ids-out-of-vocab", "/v1/completions",
     {**OK, "allowed_token_ids": [99999]}, 400, "allowed_token_ids"),
    ("logit-bias-out-of-vocab", "/v1/completions", {**OK, "logit_bias": {"99999": 5}}, 400,
     "logit_bias"),
    # Fields that contradict each other (vLLM refuses each of them too).
    ("stream-options-without-stream", "/v1/completions",
     {**OK, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("stream-options-without-stream-chat", "/v1/chat/completions",
     {"model": "m", "messages": [{"role": "user", "content": "hi"}],
      "stream_options": {"include_usage": False}}, 400, "stream_options"),
    ("max-tokens-past-model-length", "/v1/completions",
     {**OK, "prompt": "x" * 250, "max_tokens": 10}, 400, "max_tokens"),
    ("best-of-below-n", "/v1/completions", {**OK, "n": 2, "best_of": 1}, 400, "best_of"),
    ("empty-prompt-string", "/v1/completions", {**OK, "prompt": ""}, 400, "prompt"),
    ("empty-prompt-in-list", "/v1/completions", {**OK, "prompt": ["a", ""]}, 400, "prompt"),
    ("empty-stop-string", "/v1/completions", {**OK, "stop": ["a", ""]}, 400, "stop"),
    # Options that would change the result and are not implemented: refused, not ignored.
    ("response-format-json", "/v1/completions",
     {**OK, "response_format": {"type": "json_object"}}, 400, "response_format"),
    ("guided-json", "/v1/completions", {**OK, "guided_json": {"type": "object"}}, 400,
     "guided_json"),
    ("beam-search", "/v1/completions", {**OK, "use_beam_search": True}, 400,
     "use_beam_search"),
    ("continuous-usage-stats", "/v1/completions",
     {**OK, "stream": True, "stream_options": {"continuous_usage_stats": True}}, 400,
     "stream_options.continuous_usage_stats"),
    ("tool-choice-required", "/v1/chat/completions",
     {"model": "m", "messages": [{"role": "user", "content": "hi"}],
      "tool_choice": "required"}, 400, "tool_choice"),
    ("continue-final-message", "/v1/chat/completions",
     {"model": "m", "messages": [{"role": "user", "content": "hi"}],
      "continue_final_message": True}, 400, "continue_final_message"),
    # More sequences than the server ever holds at once (256 + 1024): a 400, not a 503 to
    # retry forever.
    ("more-sequences-than-capacity", "/v1/completions", {**OK, "prompt": ["a"] * 1281}, 400,
     "n"),
]


def _post(server: LiveServer, path: str, body: Any, **kw: Any) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(server.url + path, content=body,
                          headers={"content-type": "application/json"}, **kw)
    return httpx.post(server.url + path, json=body, **kw)


def _assert_openai_error(resp: httpx.Response, status: int, param: str | None) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"]
    assert error["param"] == param


@pytest.mark.parametrize("name,path,body,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_an_openai_error(demo_server: LiveServer, name: str, path: str, body: Any,
                                      status: int, param: str | None) -> None:
    _assert_openai_error(_post(demo_server, path, body), status, param)
    # The server still serves.
    ok = _post(demo_server, "/v1/completions", OK)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop",
                                                                                  "length")


def test_prompt_too_long_names_both_lengths(demo_server: LiveServer) -> None:
    message = _post(demo_server, "/v1/completions", {**OK, "prompt": "x" * 300}).json()
    assert "301" in message["error"]["message"] and "256" in message["error"]["message"]


def test_max_tokens_past_the_model_length_names_the_numbers(demo_server: LiveServer) -> None:
    message = _post(demo_server, "/v1/completions",
                    {**OK, "prompt": "x" * 250, "max_tokens": 10}).json()["error"]["message"]
    # 251 prompt tokens (BOS included) of 256: 5 left, 10 asked.
    assert all(str(n) in message for n in (10, 256, 251, 5)), message


def test_ten_megabyte_body_is_413(demo_server: LiveServer) -> None:
    body = b'{"model": "m", "prompt": "' + b"a" * (10 * 2**20) + b'"}'
    _assert_openai_error(_post(demo_server, "/v1/completions", body), 413, None)
    assert _post(demo_server, "/v1/completions", OK).status_code == 200


def test_api_key() -> None:
    server = LiveServer("demo", api_key="sekret", max_model_len=64,
                        enable_tokenizer_info_endpoint=True)
    try:
        _assert_openai_error(_post(server, "/v1/completions", OK), 401, None)
        wrong = _post(server, "/v1/completions", OK, headers={"authorization": "Bearer no"})
        _assert_openai_error(wrong, 401, None)
        good = _post(server, "/v1/completions", OK, headers={"authorization": "Bearer sekret"})
        assert good.status_code == 200
        for route, body in [("/tokenize", {"model": "m", "prompt": "a"}),
                            ("/detokenize", {"model": "m", "tokens": [1]})]:
            _assert_openai_error(_post(server, route, body), 401, None)
            assert _post(server, route, body,
                         headers={"authorization": "Bearer sekret"}).status_code == 200
        _assert_openai_error(httpx.get(server.url + "/tokenizer_info"), 401, None)
        assert httpx.get(server.url + "/tokenizer_info",
                         headers={"authorization": "Bearer sekret"}).status_code == 200
        assert httpx.get(server.url + "/health").status_code == 200  # open to probes
    finally:
        server.stop()


def test_models_health_metrics(demo_server: LiveServer) -> None:
    models = httpx.get(demo_server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["m"]
    assert models["data"][0]["max_model_len"] == 256
    assert httpx.get(demo_server.url + "/health").json() == {"status": "ok"}
    _post(demo_server, "/v1/completions", OK)
    metrics = httpx.get(demo_server.url + "/metrics").text
    for name in ("pagedcore:num_requests_running", "pagedcore:num_requests_waiting",
                 "pagedcore:kv_cache_usage_perc", "pagedcore:prefix_cache_hit_rate",
                 "pagedcore:num_preemptions_total", "pagedcore:time_to_first_token_seconds_bucket",
                 "pagedcore:time_per_output_token_seconds_bucket",
                 "pagedcore:e2e_request_latency_seconds_bucket",
                 "pagedcore:prompt_tokens_total", "pagedcore:generation_tokens_total"):
        assert name in metrics, name
    generated = [line for line in metrics.splitlines()
                 if line.startswith("pagedcore:generation_tokens_total")]
    assert float(generated[0].split()[-1]) >= 2
