"""Conversations to prompt token ids through the tokenizer's chat template.

The template writes the special tokens itself (BOS, role markers), so the rendered text is
tokenized *without* adding special tokens again, as vLLM does: the ids equal
``tokenizer.apply_chat_template(messages, tokenize=True)``. `pagedcore.serve` uses the same
function for ``/v1/chat/completions``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pagedcore.engine.validation import InvalidArgumentError, InvalidArgumentTypeError, describe

__all__ = ["ChatTemplateError", "Conversation", "chat_prompt", "chat_prompt_ids",
           "normalize_conversations"]

#: One conversation: messages ``{"role": ..., "content": ...}`` in order.
Conversation = Sequence[Mapping[str, Any]]


class ChatTemplateError(InvalidArgumentError):
    """The model has no chat template, or the template failed on a conversation."""


def normalize_conversations(
    messages: Conversation | Sequence[Conversation],
) -> list[list[dict[str, Any]]]:
    """One conversation or a list of them -> a list of conversations (lists of dicts).

    Raises
    ------
    InvalidArgumentError
        (a TypeError too for a wrong type) Not messages, an empty conversation, or a message
        without a str ``role``.
    """
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise InvalidArgumentTypeError(
            "messages must be a list of {'role': ..., 'content': ...} dicts, or a list of "
            f"such lists (one per conversation), got {describe(messages)}")
    if not messages:
        raise InvalidArgumentError("messages is empty; give at least one message")
    single = isinstance(messages[0], Mapping)
    conversations = [messages] if single else list(messages)
    out = []
    for number, conversation in enumerate(conversations):
        where = "" if single else f" (conversation {number})"
        if isinstance(conversation, (str, bytes, Mapping)) or not isinstance(conversation,
                                                                             Sequence):
            raise InvalidArgumentTypeError(
                f"a conversation must be a list of message dicts{where}, got "
                f"{describe(conversation)}")
        if not conversation:
            raise InvalidArgumentError(f"a conversation is empty{where}; give a message")
        for message in conversation:
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise InvalidArgumentTypeError(
                    f"every message must be a dict with a str 'role'{where}, got "
                    f"{describe(message)}")
        out.append([_text_content(dict(m), where) for m in conversation
                    if isinstance(m, Mapping)])
    return out


def _text_content(message: dict[str, Any], where: str) -> dict[str, Any]:
    """`message` with OpenAI-style content parts (``[{"type": "text", "text": ...}, ...]``)
    joined into one str, as the server does (vLLM too, for templates that expect a str)."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for part in content:
        if not (isinstance(part, Mapping) and part.get("type") == "text"
                and isinstance(part.get("text"), str)):
            raise InvalidArgumentError(
                f"a message's content parts must be {{'type': 'text', 'text': str}}{where} "
                f"(this engine runs text-only models), got {describe(part)}")
        texts.append(part["text"])
    return {**message, "content": "".join(texts)}


def chat_prompt_ids(
    tokenizer: Any,
    conversation: Sequence[Mapping[str, Any]],
    *,
    model_name: str,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> list[int]:
    """The prompt token ids of `conversation` rendered by the chat template (`chat_prompt`'s
    ids; the parameters and errors are its)."""
    return chat_prompt(tokenizer, conversation, model_name=model_name,
                       chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                       **template_kwargs)[1]


def chat_prompt(
    tokenizer: Any,
    conversation: Sequence[Mapping[str, Any]],
    *,
    model_name: str,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> tuple[str, list[int]]:
    """The text `conversation` renders to through the chat template, and its token ids.

    Parameters
    ----------
    tokenizer:
        A transformers tokenizer (``apply_chat_template`` and ``encode``).
    chat_template:
        A Jinja template overriding the tokenizer's own (None: the tokenizer's).
    add_generation_prompt:
        End with the assistant's turn marker, so the model answers.
    template_kwargs:
        Extra variables for the template (``tools``, ``documents``, ...).

    Raises
    ------
    ChatTemplateError
        No tokenizer, no chat template, or the template raised on this conversation.
    """
    if tokenizer is None or not hasattr(tokenizer, "apply_chat_template"):
        raise ChatTemplateError(
            f"model {model_name!r} has no (transformers) tokenizer, so it has no chat "
            "template; pass prompts to generate(), or load a checkpoint whose tokenizer "
            "defines a chat_template")
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ChatTemplateError(
            f"model {model_name!r} has no chat template (its tokenizer_config.json defines no "
            "chat_template); pass chat_template='...' (a Jinja template), or use generate() "
            "with a prompt")
    try:
        text = tokenizer.apply_chat_template(
            list(conversation), chat_template=template, tokenize=False,
            add_generation_prompt=add_generation_prompt, **template_kwargs)
    except Exception as exc:  # jinja raises its own errors for conversations it rejects
        raise ChatTemplateError(f"the chat template failed on these messages: "
                                f"{type(exc).__name__}: {exc}") from exc
    # The template already wrote the special tokens (BOS): do not add them twice.
    text = str(text)
    return text, [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
