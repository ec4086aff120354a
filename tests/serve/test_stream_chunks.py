"""The text-only stream path (`ChunkTemplate`, `OpenAIServing._text_stream`) sends what the
dict-per-chunk path sends, byte for byte: completions and chat, one sequence and several,
texts that need escaping, the usage chunk, and an engine error mid-stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import pytest

from pagedcore.serve.deltas import StreamDelta
from pagedcore.serve.errors import RequestFailedError
from pagedcore.serve.protocol import ChatCompletionRequest, CompletionRequest
from pagedcore.serve.responses import ChunkTemplate, chat_chunk, completion_chunk, sse
from pagedcore.serve.serving import OpenAIServing, Sequence_

TEXTS = ["hi", "", 'a "quoted" \\ back', "line\nbreak\ttab\x01\x1f", "é中文😀", "</script>"]


@pytest.mark.parametrize("chat", [False, True])
def test_chunk_template_is_the_dict_chunk(chat: bool) -> None:
    rid, model = 'cmpl-"odd"', "mödel/ä"
    template = ChunkTemplate(rid, 1700000000, model, 3, chat=chat)
    for text in TEXTS:
        for finish in (None, "stop", "length", "abort"):
            if chat:
                want = sse(chat_chunk(rid, 1700000000, model, 3,
                                      {"content": text} if text else {}, finish))
            else:
                want = sse(completion_chunk(rid, 1700000000, model, 3, text, finish))
            assert template.text_event(text, finish) == want, (text, finish)


def _delta(text: str, n: int, finish: str | None = None) -> StreamDelta:
    return StreamDelta("r", text, [n], None, finish, None, 4, 1, n, None)


class _FakeFan:
    """What `OpenAIServing` needs of a `FanIn`: its sequences, their deltas (interleaved, as
    several sequences arrive), `single()` for one sequence; optionally a failure at the end."""

    def __init__(self, per_seq: list[list[StreamDelta]], fail: bool = False) -> None:
        self.seqs = [Sequence_(i, 0, [1, 2, 3, 4], None) for i in range(len(per_seq))]  # type: ignore[arg-type]
        self.per_seq = per_seq
        self.fail = fail

    def _pairs(self) -> list[tuple[int, StreamDelta]]:
        longest = max(len(d) for d in self.per_seq)
        return [(i, d[k]) for k in range(longest) for i, d in enumerate(self.per_seq)
                if k < len(d)]

    def single(self) -> AsyncGenerator[StreamDelta, None] | None:
        if len(self.per_seq) != 1:
            return None

        async def gen() -> AsyncGenerator[StreamDelta, None]:
            for _, d in self._pairs():
                yield d
            if self.fail:
                raise RequestFailedError("the step failed")
        return gen()

    async def __aiter__(self) -> AsyncIterator[tuple[int, StreamDelta]]:
        for pair in self._pairs():
            yield pair
        if self.fail:
            raise RequestFailedError("the step failed")


class _Engine:
    tokenizer = object()
    max_model_len = 64
    max_num_seqs = 8
    vocab_size = 100


async def _drain(events: AsyncIterator[bytes]) -> list[bytes]:
    return [e async for e in events]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("num_seqs", [1, 2])
@pytest.mark.parametrize("fail", [False, True])
def test_text_stream_equals_the_dict_path(chat: bool, num_seqs: int, fail: bool) -> None:
    serving = OpenAIServing(_Engine(), model_names=["m"], max_n=8)  # type: ignore[arg-type]
    per_seq = [[_delta(TEXTS[(k + s) % len(TEXTS)], k + 1) for k in range(5)]
               + [_delta("end", 6, "length")] for s in range(num_seqs)]
    options: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}}
    rid, created = "id-1", 1700000000
    if chat:
        body: Any = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                          **options)
        roles = [sse(chat_chunk(rid, created, "m", s, {"role": "assistant", "content": ""},
                                None)) for s in range(num_seqs)]
        fast = serving._text_stream(_FakeFan(per_seq, fail), [[1, 2, 3, 4]], rid, created, "m",
                                    chat=True, include_usage=True, preamble=roles)
        slow = serving._chat_events(body, _FakeFan(per_seq, fail), [[1, 2, 3, 4]], rid,
                                    created, "m", roles)
    else:
        body = CompletionRequest(model="m", prompt=[1, 2, 3, 4], **options)
        fast = serving._text_stream(_FakeFan(per_seq, fail), [[1, 2, 3, 4]], rid, created, "m",
                                    chat=False, include_usage=True)
        slow = serving._completion_events(body, _FakeFan(per_seq, fail), [[1, 2, 3, 4]], rid,
                                          created, "m")
    got, want = asyncio.run(_drain(fast)), asyncio.run(_drain(slow))
    assert got == want
    assert got[-1] == b"data: [DONE]\n\n"
    if fail:
        assert b"the step failed" in got[-2]
    else:
        assert b'"completion_tokens":' in got[-2]  # the usage chunk
    # Deltas with no text and no finish reason send nothing, as on the dict path.
    sent = sum(1 for seq in per_seq for d in seq if d.text or d.finish_reason)
    assert sent < 6 * num_seqs  # TEXTS has an empty text: something was skipped
    assert len(got) == num_seqs * chat + sent + 2  # + the usage (or error) chunk and [DONE]
