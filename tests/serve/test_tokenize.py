"""vLLM's ``/tokenize`` and ``/detokenize`` on a live server: the ids the engine would get
for a prompt or a conversation, and text back from ids; bad input gets a 400."""

from __future__ import annotations

import httpx
from serve_helpers import LiveServer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


def test_tokenize_a_prompt_and_a_conversation_as_the_engine_gets_them(
        chat_server: LiveServer) -> None:
    tok = chat_server.tokenizer
    with httpx.Client(base_url=chat_server.url) as client:
        out = client.post("/tokenize", json={"model": "m", "prompt": "Hello world",
                                             "return_token_strs": True}).json()
        ids = tok.encode("Hello world")
        assert out == {"count": len(ids), "max_model_len": 256, "tokens": ids,
                       "token_strs": tok.convert_ids_to_tokens(ids)}
        bare = client.post("/tokenize", json={"model": "m", "prompt": "Hello world",
                                              "add_special_tokens": False}).json()
        assert bare["tokens"] == tok.encode("Hello world", add_special_tokens=False)
        assert bare["token_strs"] is None  # (vLLM's shape: null unless asked)
        chat = client.post("/tokenize", json={"model": "m", "messages": MESSAGES}).json()
        want = tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
        want = want["input_ids"] if hasattr(want, "keys") else want
        assert chat["tokens"] == list(want)
        text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        special = client.post("/tokenize", json={"model": "m", "messages": MESSAGES,
                                                 "add_special_tokens": True}).json()
        assert special["tokens"] == tok.encode(text, add_special_tokens=True)
        # ... the very ids a chat completion's usage counts as its prompt.
        usage = client.post("/v1/chat/completions", json={
            "model": "m", "messages": MESSAGES, "max_tokens": 1}).json()["usage"]
        assert usage["prompt_tokens"] == chat["count"]
        back = client.post("/detokenize", json={"model": "m", "tokens": ids}).json()
        assert back == {"prompt": tok.decode(ids)}


def test_tokenize_refuses_what_it_cannot_do(chat_server: LiveServer) -> None:
    with httpx.Client(base_url=chat_server.url) as client:
        cases = [
            ("/tokenize", {"model": "m"}, 400, "exactly one of prompt"),
            ("/tokenize", {"model": "m", "prompt": "a", "messages": MESSAGES}, 400,
             "exactly one of prompt"),
            ("/tokenize", {"model": "other", "prompt": "a"}, 404, "does not exist"),
            ("/detokenize", {"model": "m", "tokens": [1, 10**9]}, 400, "outside the vocab"),
            ("/detokenize", {"model": "m", "tokens": "abc"}, 400, "tokens"),
        ]
        for route, body, status, said in cases:
            r = client.post(route, json=body)
            assert r.status_code == status and said in r.json()["error"]["message"], r.text


def test_tokenize_with_a_tokenizer_outside_transformers(demo_server: LiveServer) -> None:
    """The demo model's byte tokenizer: the ids /v1/completions would encode, token texts by
    decoding each id, and no ``add_special_tokens`` switch to honour."""
    tok = demo_server.tokenizer
    with httpx.Client(base_url=demo_server.url) as client:
        out = client.post("/tokenize", json={"model": "m", "prompt": "Hé",
                                             "return_token_strs": True}).json()
        assert out["tokens"] == tok.encode("Hé")
        assert out["token_strs"] == [tok.decode([t]) for t in out["tokens"]]
        r = client.post("/tokenize", json={"model": "m", "prompt": "a",
                                           "add_special_tokens": False})
        assert r.status_code == 400 and r.json()["error"]["param"] == "add_special_tokens"
