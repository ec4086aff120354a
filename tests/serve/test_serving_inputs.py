"""`OpenAIServing` without a server: long prompts tokenized off the event loop, per-sample
seeds wrapped into the seed range, streamed logprobs that keep the tokens whose text is held
back, and chat logprob bytes of partial UTF-8 tokens."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest
from serve_helpers import train_tokenizer
from test_eager_submit import _Fit, _Process

from pagedcore.engine.outputs import Logprob
from pagedcore.engine.validation import MAX_SEED
from pagedcore.serve import serving as serving_module
from pagedcore.serve.async_engine import AsyncEngine
from pagedcore.serve.core_loop import EngineInfo
from pagedcore.serve.deltas import StreamDelta
from pagedcore.serve.errors import BadRequestError
from pagedcore.serve.protocol import ChatCompletionRequest, CompletionRequest
from pagedcore.serve.serving import OpenAIServing


class _CountingTokenizer:
    """Encodes one id per character and records the thread each call ran on; decodes an id
    as ``<id>``."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []

    def encode(self, text: str) -> list[int]:
        self.threads.append(threading.current_thread())
        return [ord(c) % 50 + 1 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)


def _serving(tokenizer: Any = None, vocab_size: int = 100) -> tuple[_Process, OpenAIServing]:
    proc = _Process()
    proc.info = EngineInfo(model_name="m", tokenizer=tokenizer, max_model_len=1 << 20,
                           max_num_seqs=8, vocab_size=vocab_size, fit=_Fit(),
                           backend_names=("x",), device="cpu")
    engine = AsyncEngine(None, process=proc, max_waiting=0)  # type: ignore[arg-type]
    engine.start()
    return proc, OpenAIServing(engine, model_names=["m"], max_n=4)


def test_long_prompt_text_is_tokenized_on_a_worker_thread() -> None:
    tokenizer = _CountingTokenizer()
    limit = serving_module.OFF_LOOP_CHARS

    async def main() -> tuple[list[list[int]], list[list[int]]]:
        _, serving = _serving(tokenizer)
        short = await serving.completion_prompts(
            CompletionRequest(model="m", prompt="ab" * 10, max_tokens=1))
        long = await serving.completion_prompts(
            CompletionRequest(model="m", prompt=["x" * limit, "y"], max_tokens=1))
        return short, long

    short, long = asyncio.run(main())
    assert [len(p) for p in short] == [20] and [len(p) for p in long] == [limit, 1]
    loop_thread = threading.main_thread()
    assert tokenizer.threads[0] is loop_thread  # short text: no hop
    assert all(t is not loop_thread for t in tokenizer.threads[1:])  # long: off the loop


def test_a_seed_at_the_top_of_the_range_wraps_for_the_second_sample() -> None:
    async def main() -> list[int | None]:
        _, serving = _serving()
        fan, _ = serving.completion(CompletionRequest(
            model="m", prompt=[5, 6], max_tokens=1, n=3, seed=MAX_SEED))
        seeds = [s.params.seed for s in fan.seqs]
        serving.engine.release(len(fan.seqs))
        return seeds

    assert asyncio.run(main()) == [MAX_SEED, 0, 1]


class _StrippingTokenizer(_CountingTokenizer):
    """Drops whitespace: a text of spaces is no token at all."""

    def encode(self, text: str) -> list[int]:
        return super().encode(text.strip())


@pytest.mark.parametrize("prompt", ["", "   "])
def test_text_that_tokenizes_to_nothing_is_an_invalid_value_not_a_length_error(
        prompt: str) -> None:
    """An empty string is refused before it is tokenized (as vLLM refuses it); a text that
    tokenizes to nothing gets the same kind of error."""
    async def main() -> BadRequestError:
        _, serving = _serving(_StrippingTokenizer())  # (no BOS)
        with pytest.raises(BadRequestError) as info:
            serving.completion(CompletionRequest(model="m", prompt=prompt, max_tokens=1))
        return info.value

    error = asyncio.run(main())
    assert (error.param, error.code) == ("prompt", "invalid_value")
    assert "empty" in error.message


class _Fan:
    """What the event paths read of a `FanIn`: its deltas, in order."""

    def __init__(self, deltas: list[StreamDelta]) -> None:
        self.deltas = deltas
        self.seqs: list[Any] = []

    async def __aiter__(self) -> Any:
        for d in self.deltas:
            yield 0, d


def _delta(text: str, ids: list[int], finish: str | None = None) -> StreamDelta:
    logprobs = [{t: Logprob(logprob=-0.5 - t, rank=1)} for t in ids]
    return StreamDelta("r", text, ids, logprobs, finish, None, 2, 0, 0, None)


def _events(chunks: list[bytes]) -> list[dict[str, Any]]:
    out = []
    for chunk in chunks:
        payload = chunk.decode().removeprefix("data: ").strip()
        if payload != "[DONE]":
            out.append(json.loads(payload))
    return out


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_logprobs_keep_the_tokens_whose_text_was_held_back(chat: bool) -> None:
    """Tokens 11 and 12 produce no text yet (a character's first bytes, or the start of a
    possible stop string): their logprobs go out with the next chunk, so the stream carries
    one entry per token, as the response without streaming does."""
    deltas = [_delta("a", [10]), _delta("", [11]), _delta("", [12]), _delta("bc", [13]),
              _delta("", [14], finish="length")]

    async def collect() -> list[bytes]:
        _, serving = _serving(_CountingTokenizer())
        fan: Any = _Fan(deltas)
        if chat:
            body: Any = ChatCompletionRequest(model="m", messages=[], logprobs=True,
                                              top_logprobs=1, stream=True)
            run = serving._chat_events(body, fan, [[1, 2]], "id", 0, "m", [])
        else:
            body = CompletionRequest(model="m", prompt=[1, 2], logprobs=1, stream=True)
            run = serving._completion_events(body, fan, [[1, 2]], "id", 0, "m")
        return [chunk async for chunk in run]

    events = _events(asyncio.run(collect()))
    logprobs = [e["choices"][0]["logprobs"] for e in events]
    if chat:
        tokens = [entry["token"] for lp in logprobs for entry in lp["content"]]
        values = [entry["logprob"] for lp in logprobs for entry in lp["content"]]
    else:
        tokens = [t for lp in logprobs for t in lp["tokens"]]
        values = [v for lp in logprobs for v in lp["token_logprobs"]]
    assert tokens == [f"<{t}>" for t in (10, 11, 12, 13, 14)]
    assert values == [-10.5, -11.5, -12.5, -13.5, -14.5]
    assert len(events) == 3  # "a", then "bc" with the held tokens, then the finish


def test_chat_logprob_bytes_of_partial_characters_join_to_the_text() -> None:
    """A byte-level BPE token holding part of a multi-byte character decodes to U+FFFD
    alone; its ``bytes`` are its own raw bytes, so joined they give the text back."""
    from pagedcore.serve.responses import chat_logprobs

    tokenizer = train_tokenizer()
    text = "5€ for the café, ñ"  # (€ and ñ are not in the training text: split into bytes)
    ids = tokenizer.encode(text, add_special_tokens=False)
    partial = [i for i in ids if "\ufffd" in tokenizer.decode([i])]
    assert partial, "the test needs tokens that split a character"
    content = chat_logprobs(tokenizer, ids, [{i: Logprob(logprob=-1.0, rank=1)} for i in ids],
                            k=1)["content"]
    joined = b"".join(bytes(entry["bytes"]) for entry in content)
    assert joined.decode() == text
    assert all(bytes(e["top_logprobs"][0]["bytes"]) == bytes(e["bytes"]) for e in content)


def test_a_chat_template_given_to_the_server_formats_messages_without_the_tokenizers() -> None:
    """``pagedcore serve --chat-template``: the server's template renders the conversation
    when the tokenizer has none; without it the 400 names the option."""
    tokenizer = train_tokenizer()
    tokenizer.chat_template = None
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi there"}],
                                 max_tokens=1)

    async def main() -> tuple[list[int], BadRequestError]:
        _, plain = _serving(tokenizer, vocab_size=400)
        with pytest.raises(BadRequestError) as info:
            plain.chat_prompt(body)
        _, given = _serving(tokenizer, vocab_size=400)
        given.chat_template = template
        return given.chat_prompt(body), info.value

    ids, error = asyncio.run(main())
    assert ids == tokenizer.encode("<user>hi there<assistant>", add_special_tokens=False)
    assert error.code == "no_chat_template" and "--chat-template" in error.message


def test_the_chat_template_option_reads_a_file_or_a_template_and_refuses_anything_else(
        tmp_path: Any) -> None:
    from click.testing import CliRunner

    from pagedcore.cli import main as cli
    from pagedcore.cli_types import ChatTemplate

    kind = ChatTemplate()
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0].content }}", encoding="utf-8")
    assert kind.convert(str(path), None, None) == "{{ messages[0].content }}"
    assert kind.convert("{% for m in messages %}{{ m.content }}{% endfor %}", None,
                        None).startswith("{% for")
    # What transformers renders parses too: loop controls, assistant-mask blocks.
    for ok in ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{% endfor %}",
               "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}"
               "{% endfor %}"):
        assert kind.convert(ok, None, None) == ok
    path.write_bytes(b"\xef\xbb\xbf{{ messages[0].content }}")  # a byte-order mark: dropped
    assert kind.convert(str(path), None, None) == "{{ messages[0].content }}"
    runner = CliRunner()
    for value, said in [("no-such-file.jinja", "neither a file nor a Jinja template"),
                        ("{% for m in messages %}", "does not parse")]:
        result = runner.invoke(cli, ["serve", "demo", "--chat-template", value])
        assert result.exit_code == 2, result.output
        assert said in result.output and "Traceback" not in result.output


def test_tool_fields_reach_the_template_and_a_template_needs_a_transformers_tokenizer() -> None:
    """A message's ``tool_calls`` / ``tool_call_id`` are passed to the chat template; with
    ``--chat-template`` on a model whose tokenizer cannot apply one, the 400 says so instead of
    asking for the option the server already has."""
    tokenizer = train_tokenizer()
    template = ("{% for m in messages %}{{ m.role }}:{{ m.tool_call_id }}{{ m.tool_calls }}|"
                "{% endfor %}")
    body = ChatCompletionRequest(model="m", max_tokens=1, messages=[
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1"}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"}])

    async def main() -> tuple[list[int], BadRequestError]:
        _, given = _serving(tokenizer, vocab_size=400)
        given.chat_template = template
        ids = given.chat_prompt(body)
        _, plain = _serving(_CountingTokenizer())
        plain.chat_template = template
        with pytest.raises(BadRequestError) as info:
            plain.chat_prompt(body)
        return ids, info.value

    ids, error = asyncio.run(main())
    assert tokenizer.decode(ids) == "assistant:[{'id': 'c1'}]|tool:c1|"
    assert "no transformers tokenizer" in error.message and "--chat-template FILE" not in \
        error.message


def test_logprobs_json_stays_finite() -> None:
    """-inf (a masked token) and NaN become vLLM's floor -9999.0: JSON has no infinity."""
    from pagedcore.serve.responses import (
        LOGPROB_FLOOR,
        chat_logprobs,
        completion_logprobs,
        prompt_logprobs_json,
    )

    entry = {3: Logprob(logprob=float("-inf"), rank=2), 4: Logprob(logprob=float("nan"), rank=1)}
    legacy = completion_logprobs(None, [3, 4], [entry, entry], k=2, text_offset=0)
    chat = chat_logprobs(None, [3], [entry], k=2)
    values = legacy["token_logprobs"] + [v for top in legacy["top_logprobs"]
                                         for v in top.values()]
    values += [chat["content"][0]["logprob"]] + [e["logprob"] for e in
                                                  chat["content"][0]["top_logprobs"]]
    values += [v["logprob"] for v in prompt_logprobs_json([None, entry])[1].values()]  # type: ignore[index]
    assert values and all(v == LOGPROB_FLOOR for v in values)
    json.dumps(legacy, allow_nan=False)


def test_tokenize_honours_add_special_tokens_both_ways() -> None:
    """With a tokenizer that adds BOS on encode: a prompt gets it by default and not with
    ``add_special_tokens: false``; messages get none by default (the template wrote them) and
    one more with ``add_special_tokens: true``."""
    from tokenizers.processors import TemplateProcessing

    from pagedcore.serve.protocol import TokenizeRequest

    tokenizer = train_tokenizer()
    bos = tokenizer.convert_tokens_to_ids("<s>")
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)])
    plain = tokenizer.encode("Hello world", add_special_tokens=False)
    messages = [{"role": "user", "content": "Hi!"}]

    async def main() -> list[list[int]]:
        _, serving = _serving(tokenizer, vocab_size=400)
        bodies = [TokenizeRequest(prompt="Hello world"),
                  TokenizeRequest(prompt="Hello world", add_special_tokens=False),
                  TokenizeRequest(messages=messages),  # type: ignore[list-item]
                  TokenizeRequest(messages=messages, add_special_tokens=True)]  # type: ignore[list-item]
        return [(await serving.tokenize(b))["tokens"] for b in bodies]

    default, bare, chat, chat_special = asyncio.run(main())
    assert default == [bos, *plain] and bare == plain
    assert chat_special == [bos, *chat] and chat.count(bos) == 1
