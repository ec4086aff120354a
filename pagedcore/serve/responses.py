"""OpenAI response objects (plain dicts ready for JSON): completions, chat, chunks, logprobs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedcore.engine.outputs import Logprob

__all__ = [
    "chat_chunk",
    "chat_logprobs",
    "completion_chunk",
    "completion_logprobs",
    "prompt_logprobs_json",
    "sse",
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


def _token_text(tokenizer: Any, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    text: str = tokenizer.decode([token_id])
    return text


def _ranked(top: dict[int, Logprob], k: int) -> list[tuple[int, float]]:
    return sorted(((t, lp.logprob) for t, lp in top.items()), key=lambda kv: kv[1],
                  reverse=True)[:k]


def _of(top: dict[int, Logprob], token_id: int) -> float:
    entry = top.get(token_id)
    return float("-inf") if entry is None else float(entry.logprob)


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
        tops.append({_token_text(tokenizer, t): float(lp) for t, lp in _ranked(top, k)})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": offsets}


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
            "bytes": list(text.encode()),
            "top_logprobs": [
                {"token": (t_text := _token_text(tokenizer, t)), "logprob": float(lp),
                 "bytes": list(t_text.encode())}
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
        str(t): {"logprob": float(lp.logprob), "rank": lp.rank,
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
