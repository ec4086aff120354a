"""OpenAI response objects (plain dicts ready for JSON): completions, chat, chunks, logprobs."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedcore.engine.outputs import Logprob

__all__ = [
    "ChunkTemplate",
    "chat_chunk",
    "chat_logprobs",
    "completion_chunk",
    "completion_logprobs",
    "echo_logprobs",
    "join_logprobs",
    "next_offset",
    "prompt_logprobs_json",
    "sse",
    "top_prompt_logprobs",
    "usage",
]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's ``usage`` object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    import json

    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False,
                                                               separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class ChunkTemplate:
    """The server-sent events of one streamed choice, as bytes, without a dict or a
    `json.dumps` per token: the chunk's fixed fields are encoded once per request, and a
    token's chunk is a prefix, the JSON string of its text and a suffix.

    `text_event` returns exactly ``sse(completion_chunk(...))`` (or ``sse(chat_chunk(...))``
    with ``delta={"content": text}``, ``{}`` for no text) of a chunk without logprobs: the
    same keys in the same order, the text escaped by the same encoder as `sse`'s
    ``json.dumps(..., ensure_ascii=False)``. At a stream interval of 1 the front end writes one
    chunk per token of every stream, so this is on its hottest path (see docs/serving.md).

    Parameters
    ----------
    request_id, created, model:
        The chunk's ``id``, ``created`` and ``model``.
    index:
        The choice's ``index``.
    chat:
        ``chat.completion.chunk`` chunks (the text in ``delta.content``) instead of
        ``text_completion`` ones (the text in ``text``).
    """

    __slots__ = ("_empty", "_head", "_tail")

    def __init__(self, request_id: str, created: int, model: str, index: int, *,
                 chat: bool = False) -> None:
        import json

        def enc(value: Any) -> str:
            return json.dumps(value, ensure_ascii=False, separators=(",", ":"))

        kind = "chat.completion.chunk" if chat else "text_completion"
        head = (f'data: {{"id":{enc(request_id)},"object":"{kind}","created":{int(created)},'
                f'"model":{enc(model)},"choices":[{{"index":{int(index)},')
        if chat:
            self._head = (head + '"delta":{"content":').encode()
            self._empty = (head + '"delta":{},').encode()
            self._tail = b'},"logprobs":null,"finish_reason":'
        else:
            self._head = (head + '"text":').encode()
            self._empty = b""
            self._tail = b',"logprobs":null,"finish_reason":'

    def text_event(self, text: str, finish_reason: str | None) -> bytes:
        """The event of a chunk with `text` (str; may be empty) and `finish_reason`."""
        from json.encoder import encode_basestring

        finish = b"null" if finish_reason is None else encode_basestring(finish_reason).encode()
        if self._empty and not text:  # chat: an empty delta is ``{}``
            return b"".join((self._empty, b'"logprobs":null,"finish_reason":', finish,
                             b'}],"usage":null}\n\n'))
        return b"".join((self._head, encode_basestring(text).encode(), self._tail, finish,
                         b'}],"usage":null}\n\n'))


def _token_text(tokenizer: Any, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    text: str = tokenizer.decode([token_id])
    return text


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's, `tokenizers.pre_tokenizers.ByteLevel`) inverted:
    character -> byte. The printable bytes ``!``..``~``, ``¡``..``¬`` and ``®``..``ÿ`` stand
    for themselves; the other 68, in byte order, for the characters from U+0100 up."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table: dict[str, int] = {}
    shifted = 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(0x100 + shifted)] = byte
            shifted += 1
    return table


def _raw_token_bytes(tokenizer: Any, token_id: int) -> bytes | None:
    """A token's own bytes where its text alone is not valid UTF-8 (a piece of a multi-byte
    character): from a byte-level BPE piece, or a ``<0xNN>`` byte-fallback piece; None when
    the tokenizer is neither kind."""
    from pagedcore.engine.detokenizer import backend_tokenizer

    piece = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(piece, str):
        return None
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            return None
    backend = backend_tokenizer(tokenizer)
    if backend is None or type(backend.decoder).__name__ != "ByteLevel":
        return None
    alphabet = _byte_level_alphabet()
    if not all(c in alphabet for c in piece):
        return None
    return bytes(alphabet[c] for c in piece)


def _token_bytes(tokenizer: Any, token_id: int, text: str) -> list[int]:
    """The ``bytes`` of a chat logprobs entry: the UTF-8 of the token's text, or, where that
    text is a replacement character standing for part of a multi-byte character, the token's
    raw bytes (so a client joining the entries' bytes gets the text back, as OpenAI's do)."""
    if tokenizer is not None and "\ufffd" in text:
        raw = _raw_token_bytes(tokenizer, token_id)
        if raw is not None:
            return list(raw)
    return list(text.encode())


#: The floor of every logprob in a response (vLLM's): JSON has no infinity, and a masked
#: token's -inf (or a NaN) would otherwise make the response unencodable.
LOGPROB_FLOOR = -9999.0


def _json_logprob(value: float) -> float:
    value = float(value)
    return value if value > LOGPROB_FLOOR else LOGPROB_FLOOR  # (NaN too)


def _ranked(top: dict[int, Logprob], k: int) -> list[tuple[int, float]]:
    return sorted(((t, lp.logprob) for t, lp in top.items()), key=lambda kv: kv[1],
                  reverse=True)[:k]


def _top_by_text(tokenizer: Any, top: dict[int, Logprob], k: int,
                 token_id: int) -> dict[str, float]:
    """The legacy ``top_logprobs`` entry: the top `k` and the chosen token `token_id` (so up
    to k + 1 entries, as OpenAI documents), keyed by their text; tokens sharing a text (byte
    pieces that each decode to U+FFFD) keep the likelier one's logprob."""
    out: dict[str, float] = {}
    for t, lp in _ranked(top, k):
        out.setdefault(_token_text(tokenizer, t), _json_logprob(lp))
    if token_id in top:
        out.setdefault(_token_text(tokenizer, token_id), _json_logprob(top[token_id]))
    return out


def next_offset(logprobs: dict[str, Any] | None, default: int) -> int:
    """The text offset after the last token of a legacy ``logprobs`` object (its last offset
    plus its last token's text), or `default` when it has no tokens."""
    if not logprobs or not logprobs["tokens"]:
        return default
    return int(logprobs["text_offset"][-1]) + len(logprobs["tokens"][-1])


def _of(top: dict[int, Logprob], token_id: int) -> float:
    entry = top.get(token_id)
    return LOGPROB_FLOOR if entry is None else _json_logprob(entry.logprob)


def completion_logprobs(
    tokenizer: Any,
    token_ids: Sequence[int],
    logprobs: Sequence[dict[int, Logprob]],
    *,
    k: int,
    text_offset: int,
) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object of some generated tokens.

    Parameters
    ----------
    token_ids, logprobs:
        The tokens and, per token, ``{token_id: Logprob}`` (the sampled one and the top ones).
    k:
        Top entries per token to list.
    text_offset:
        Characters of the completion text before the first of these tokens.
    """
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = text_offset
    for token_id, top in zip(token_ids, logprobs, strict=False):
        text = _token_text(tokenizer, token_id)
        tokens.append(text)
        token_logprobs.append(_of(top, token_id))
        tops.append(_top_by_text(tokenizer, top, k, token_id))
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": offsets}


def echo_logprobs(
    tokenizer: Any,
    prompt_ids: Sequence[int],
    entries: Sequence[dict[int, Logprob] | None] | None,
    *,
    k: int,
) -> dict[str, Any]:
    """The legacy completions ``logprobs`` of an echoed prompt: per prompt token its text,
    its logprob and top `k` (None for the first token, which nothing predicts, as OpenAI and
    vLLM give it), and its offset in the prompt's text.

    Parameters
    ----------
    entries:
        The prompt logprobs (`RequestOutput.prompt_logprobs`: None, then ``{token_id:
        Logprob}`` per prompt token); None: none computed (every logprob is None).
    """
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = 0
    for i, token_id in enumerate(prompt_ids):
        text = _token_text(tokenizer, token_id)
        entry = entries[i] if entries is not None and i < len(entries) else None
        tokens.append(text)
        token_logprobs.append(None if entry is None else _of(entry, token_id))
        tops.append(None if entry is None else _top_by_text(tokenizer, entry, k, token_id))
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": offsets}


def join_logprobs(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two legacy ``logprobs`` objects one after the other (an echoed prompt's, then the
    completion's)."""
    return {key: list(first[key]) + list(second[key]) for key in first}


def top_prompt_logprobs(
    entries: Sequence[dict[int, Logprob] | None] | None, prompt_ids: Sequence[int], k: int,
) -> list[dict[int, Logprob] | None] | None:
    """`entries` cut to the top `k` of each position plus the prompt's own token (the engine
    may have computed more for echo's logprobs than ``prompt_logprobs`` asked)."""
    if entries is None:
        return None
    return [None if entry is None else
            {t: lp for t, lp in entry.items()
             if t == prompt_ids[i] or (lp.rank is not None and lp.rank <= k)}
            for i, entry in enumerate(entries)]


def chat_logprobs(
    tokenizer: Any,
    token_ids: Sequence[int],
    logprobs: Sequence[dict[int, Logprob]],
    *,
    k: int,
) -> dict[str, Any]:
    """The chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    content = []
    for token_id, top in zip(token_ids, logprobs, strict=False):
        text = _token_text(tokenizer, token_id)
        content.append({
            "token": text,
            "logprob": _of(top, token_id),
            "bytes": _token_bytes(tokenizer, token_id, text),
            "top_logprobs": [
                {"token": (t_text := _token_text(tokenizer, t)), "logprob": _json_logprob(lp),
                 "bytes": _token_bytes(tokenizer, t, t_text)}
                for t, lp in _ranked(top, k)
            ],
        })
    return {"content": content}


def completion_chunk(
    request_id: str, created: int, model: str, index: int, text: str,
    finish_reason: str | None, logprobs: dict[str, Any] | None = None,
    prompt_logprobs: list[dict[str, Any] | None] | None = None,
) -> dict[str, Any]:
    """A ``text_completion`` stream chunk of one choice (``prompt_logprobs`` only when given)."""
    choice: dict[str, Any] = {"index": index, "text": text, "logprobs": logprobs,
                              "finish_reason": finish_reason}
    if prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs
    return {
        "id": request_id, "object": "text_completion", "created": created, "model": model,
        "choices": [choice], "usage": None,
    }


def prompt_logprobs_json(
    entries: Sequence[dict[int, Logprob] | None] | None,
) -> list[dict[str, Any] | None] | None:
    """vLLM's ``prompt_logprobs`` of a completions choice: per prompt token ``None`` (the
    first) or ``{"<token id>": {"logprob", "rank", "decoded_token"}}``."""
    if entries is None:
        return None
    return [None if entry is None else {
        str(t): {"logprob": _json_logprob(lp.logprob), "rank": lp.rank,
                 "decoded_token": lp.decoded_token}
        for t, lp in entry.items()} for entry in entries]


def chat_chunk(
    request_id: str, created: int, model: str, index: int, delta: dict[str, Any],
    finish_reason: str | None, logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A ``chat.completion.chunk`` of one choice."""
    return {
        "id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                     "finish_reason": finish_reason}],
        "usage": None,
    }
