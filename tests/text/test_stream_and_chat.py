"""Delta streams (text never splits a character, deltas concatenate to the final text),
llm.chat through the chat template, and `pagedcore generate --stream / --chat`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner
from tokenizer_helpers import make_chat_checkpoint

from pagedcore.engine.chat import ChatTemplateError
from pagedcore.engine.llm import LLM
from pagedcore.engine.sampling.sampling_params import SamplingParams

#: Prompts in the corpus's scripts: greedy output from them is full of multi-byte characters.
PROMPTS = ["日本の首都", "crème brûlée", "Élodie said déjà", "日本 and é are"]


def _concat_stream(llm: LLM, prompts: list[str], params: SamplingParams) -> dict[str, Any]:
    texts: dict[str, list[str]] = {}
    ids: dict[str, list[int]] = {}
    last: dict[str, Any] = {}
    for out in llm.stream(prompts, params):
        assert out.delta
        c = out.outputs[0]
        texts.setdefault(out.request_id, []).append(c.text)
        ids.setdefault(out.request_id, []).extend(c.token_ids)
        last[out.request_id] = out
    assert all(o.finished for o in last.values())
    return {rid: ("".join(texts[rid]), ids[rid], last[rid]) for rid in texts}


def test_stream_deltas_concatenate_to_the_final_text(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                            allowed_token_ids=tuple(range(7, len(llm.tokenizer))))
    final = llm.generate(PROMPTS, params)
    streamed = _concat_stream(llm, PROMPTS, params)
    assert len(streamed) == len(PROMPTS)
    by_prompt = {o.prompt: o.outputs[0] for o in final}
    halves = stitched = 0
    for text, ids, last in streamed.values():
        want = by_prompt[last.prompt]
        assert ids == want.token_ids and text == want.text
        # Never half a character: a replacement character only where the whole output's
        # bytes are invalid UTF-8 (random weights emit such bytes), never at a delta's edge.
        whole = llm.tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
        assert text == whole
        halves += sum("\ufffd" in llm.tokenizer.decode([t]) for t in ids)
        stitched += halves - whole.count("\ufffd")
    assert halves and stitched > 0  # tokens really held parts of characters, joined again


def test_stream_with_a_stop_string_holds_back_its_start(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    [full] = llm.generate([PROMPTS[1]], params)
    text = full.outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    [(streamed, _, last)] = _concat_stream(llm, [PROMPTS[1]],
                                           params.replace(stop=[stop])).values()
    assert streamed == text[: text.find(stop)]
    assert last.outputs[0].stop_reason == stop


def test_chat_prompt_ids_equal_apply_chat_template(llm: LLM) -> None:
    tok = llm.tokenizer
    conversations = [
        [{"role": "user", "content": "Hello world!"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "日本?"},
         {"role": "assistant", "content": "東京です。"}, {"role": "user", "content": "é"}],
    ]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.chat(conversations, params)
    for conv, out in zip(conversations, outs, strict=True):
        want = tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=True)
        want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
        assert out.prompt_token_ids == list(want)
        assert out.prompt_token_ids.count(tok.bos_token_id) == 1  # no double BOS
        # The rendered conversation is the output's prompt text, as vLLM's chat gives it.
        assert out.prompt == tok.apply_chat_template(conv, tokenize=False,
                                                     add_generation_prompt=True)
    [one] = llm.chat(conversations[0], params, add_generation_prompt=False)
    assert one.prompt_token_ids[-1] == tok.convert_tokens_to_ids("<|end|>")
    [custom] = llm.chat(conversations[0], params, chat_template="{{ messages[0]['content'] }}")
    assert custom.prompt_token_ids == tok.encode("Hello world!", add_special_tokens=False)
    assert custom.prompt == "Hello world!"


def test_chat_content_parts_join_into_the_text_the_template_sees(llm: LLM) -> None:
    """OpenAI-style content parts, as the server takes them: joined, not rendered as a
    Python list; a non-text part is refused naming what is allowed."""
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello "},
                                          {"type": "text", "text": "world!"}]}]
    [joined] = llm.chat(parts, params)
    [plain] = llm.chat([{"role": "user", "content": "Hello world!"}], params)
    assert joined.prompt_token_ids == plain.prompt_token_ids
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValueError, match="content parts must be"):
        llm.chat(image, params)


def test_chat_without_a_template_is_a_clear_error(tmp_path: Path) -> None:
    path = make_chat_checkpoint(tmp_path / "plain")
    config = path / "tokenizer_config.json"
    import json

    data = json.loads(config.read_text())
    data.pop("chat_template", None)
    config.write_text(json.dumps(data))
    (path / "chat_template.jinja").unlink(missing_ok=True)
    llm = LLM(str(path), device="cpu", backend="reference", max_model_len=64,
              kv_cache_memory_bytes=4 * 2**20)
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        llm.chat([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="messages is empty"):
        llm.chat([])


def test_cli_streams_and_chats(multi_eos_checkpoint: Path) -> None:
    from pagedcore.cli import main

    args = ["generate", "--model", str(multi_eos_checkpoint), "--device", "cpu",
            "--backend", "reference", "--max-tokens", "6", "--max-model-len", "64"]
    runner = CliRunner()
    echoed: list[str] = []
    real_echo = click.echo

    def recording(message: Any = None, *a: Any, **kw: Any) -> None:
        echoed.append(str(message))
        real_echo(message, *a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(click, "echo", recording)
        streamed = runner.invoke(main, [*args, "--prompt", "Hello", "--stream"])
    assert streamed.exit_code == 0, streamed.output
    # Printed as it came: several pieces of text before the finish line, not one at the end.
    assert len([e for e in echoed[:-1] if e]) >= 2, echoed
    plain = runner.invoke(main, [*args, "--prompt", "Hello"])
    text = eval(plain.output.split("] ", 1)[1].rsplit(" (", 1)[0])  # the repr'd text
    assert f"{text}\n[gen-0] (length)" in streamed.output
    chat = runner.invoke(main, [*args, "--prompt", "Hello", "--system", "Be brief."])
    assert chat.exit_code == 0, chat.output
    assert chat.output != plain.output
