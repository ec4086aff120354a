"""OpenAI request bodies (pydantic, strict types) and their mapping onto `SamplingParams`.

Bodies are validated from the raw JSON in strict mode, so ``"temperature": "0.5"`` is a 400
naming the field rather than a silent conversion. Unknown fields are ignored (clients send
many OpenAI options an inference server has no use for); options that would change the result
and are not implemented (``best_of`` other than ``n``, ``suffix``, tools, structured output,
beam search, ...) are refused with a 400 naming them, as are fields that contradict each other
(``stream_options`` without ``stream: true``, ``best_of < n``, an empty stop string).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pagedcore.serve.errors import BadRequestError

if TYPE_CHECKING:
    from pagedcore.engine.sampling.sampling_params import SamplingParams

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "DetokenizeRequest",
    "SamplingLimits",
    "TokenizeRequest",
    "sampling_params",
]

#: Most top log-probabilities per token a request may ask for (OpenAI's limit).
MAX_LOGPROBS = 20


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    """``stream_options``: ``include_usage`` adds a final chunk with the token counts."""

    include_usage: bool = False
    #: vLLM's usage in every chunk: not implemented, refused when true.
    continuous_usage_stats: bool = False


class _SamplingFields(_Body):
    """The sampling fields both endpoints share (OpenAI's plus vLLM's extensions)."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    seed: int | None = None
    #: vLLM's extension: top log-probabilities of every prompt token (completions: each
    #: choice's ``prompt_logprobs``; chat: the response's).
    prompt_logprobs: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    min_tokens: int = 0
    repetition_penalty: float | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's and OpenAI's options that would change the result and are not implemented here:
    # declared so that setting them is refused (`_check_fields`), not silently ignored.
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    use_beam_search: Any = None
    truncate_prompt_tokens: Any = None

    @model_validator(mode="after")
    def _check_fields(self) -> _SamplingFields:
        """Fields that contradict each other, and options this server does not implement:
        a 400 naming the field (pydantic passes a `BadRequestError` through unchanged)."""
        if self.stream_options is not None and self.stream_options.model_fields_set \
                and not self.stream:
            # vLLM refuses it too ("Stream options can only be defined when `stream=True`.")
            raise BadRequestError("stream_options can only be given with stream: true; set "
                                  "stream: true, or leave stream_options out",
                                  param="stream_options", code="invalid_value")
        if any(s == "" for s in self.stop_strings()):
            raise BadRequestError("stop must not contain an empty string; drop it (with no "
                                  "stop strings a request stops on EOS and stop_token_ids "
                                  "only)", param="stop", code="invalid_value")
        _refuse_unsupported(self)
        return self

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: one prompt (text or token ids) or a list of them."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    #: Each choice's text (and logprobs) starts with the prompt's; with ``max_tokens: 0`` it
    #: is the prompt alone (scoring a text, as evaluation harnesses do).
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the prompt is scored, nothing is generated."""
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list (a list of ints is one prompt of token ids).

        Raises
        ------
        BadRequestError
            No prompt, or an empty string among them (vLLM refuses it too: with a tokenizer
            that adds no BOS it is no token at all, and with one that does it asks for an
            unconditioned sample, which token ids say explicitly).
        """
        p = self.prompt
        if not isinstance(p, str) and not p:
            raise BadRequestError("prompt is empty; give a string, token ids or a list of them",
                                  param="prompt", code="invalid_value")
        given: list[str | list[int]] = (
            [p] if isinstance(p, str) else [list(p)] if isinstance(p[0], int) else list(p))
        for i, one in enumerate(given):
            if one == "":
                where = "prompt" if isinstance(p, str) else f"prompt {i} of the list"
                raise BadRequestError(f"{where} is an empty string; give some text (or token "
                                      "ids, e.g. the BOS id alone for an unconditioned sample)",
                                      param="prompt", code="invalid_value")
        return given


class _TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    """One message of a conversation (text content; a list of text parts is joined)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None
    name: str | None = None
    #: Passed to the chat template as given (templates of tool-calling models read them).
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None

    def text_length(self) -> int:
        """Characters of text the message holds."""
        content = self.content
        if isinstance(content, list):
            return sum(len(part.text) for part in content)
        return len(content or "")

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls is not None:
            message["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(default_factory=list)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[Any] | None = None
    # Refused when set (`_refuse_unsupported`): legacy function calling, a forced tool call,
    # continuing the last message instead of starting the assistant's.
    functions: Any = None
    tool_choice: Any = None
    continue_final_message: Any = None

    @property
    def num_logprobs(self) -> int | None:
        """Top logprobs per token (None: no logprobs); BadRequestError for ``top_logprobs``
        without ``logprobs: true`` (OpenAI refuses it too)."""
        if not self.logprobs:
            if self.top_logprobs is not None:
                raise BadRequestError("top_logprobs needs logprobs: true (set both, or leave "
                                      "top_logprobs out)", param="top_logprobs",
                                      code="invalid_value")
            return None
        return self.top_logprobs or 0


class TokenizeRequest(_Body):
    """``POST /tokenize`` (vLLM's): a text, or a conversation through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    #: None: True for a prompt, False for messages (the template writes the special tokens).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    """``POST /detokenize`` (vLLM's): token ids back to text."""

    model: str | None = None
    tokens: list[int]


class SamplingLimits:
    """What the server allows: the longest model length, the most samples per request, and
    the token ids the model has (``[0, vocab_size)``; None: not checked here)."""

    def __init__(self, *, max_model_len: int, max_n: int, vocab_size: int | None = None) -> None:
        self.max_model_len = max_model_len
        self.max_n = max_n
        self.vocab_size = vocab_size



def _param_of(exc: ValueError, body: _SamplingFields) -> str | None:
    """The request field an error of `SamplingParams` is about (None when it names none)."""
    fields: tuple[str, ...] = getattr(exc, "fields", ())
    if not fields:
        return None
    field = fields[0]
    if field == "max_tokens" and isinstance(body, ChatCompletionRequest) \
            and body.max_completion_tokens is not None:
        return "max_completion_tokens"
    if field == "logprobs" and isinstance(body, ChatCompletionRequest):
        return "top_logprobs"
    return field


def _refuse_unsupported(body: _SamplingFields) -> None:
    """BadRequestError for an option this server does not implement that is set to a value
    which would change the result (at its default it is accepted, and changes nothing)."""
    refused: list[str] = []
    if isinstance(body, CompletionRequest):
        if body.best_of is not None and body.best_of < body.n:
            raise BadRequestError(f"best_of ({body.best_of}) must be >= n ({body.n}); leave "
                                  "best_of out (or set it to n)", param="best_of",
                                  code="invalid_value")
        if body.best_of not in (None, body.n):
            refused.append("best_of")
        if body.suffix:
            refused.append("suffix")
    response_format = body.response_format
    if response_format is not None and response_format != {"type": "text"}:
        refused.append("response_format")
    refused += [name for name in ("structured_outputs", "guided_json", "guided_regex",
                                  "guided_choice", "guided_grammar", "truncate_prompt_tokens")
                if getattr(body, name) is not None]
    if body.use_beam_search not in (None, False):
        refused.append("use_beam_search")
    if body.stream_options is not None and body.stream_options.continuous_usage_stats:
        refused.append("stream_options.continuous_usage_stats")
    if isinstance(body, ChatCompletionRequest):
        if body.tools:
            refused.append("tools")
        if body.functions:
            refused.append("functions")
        if body.tool_choice not in (None, "none", "auto"):
            refused.append("tool_choice")
        if body.continue_final_message not in (None, False):
            refused.append("continue_final_message")
    if refused:
        raise BadRequestError(f"{', '.join(refused)} {'is' if len(refused) == 1 else 'are'} not "
                              "supported by this server; leave it out (or at its default)",
                              param=refused[0], code="unsupported")


def sampling_params(
    body: _SamplingFields,
    *,
    num_prompt_tokens: int,
    limits: SamplingLimits,
    num_logprobs: int | None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """The `SamplingParams` of one sample of `body` (n = 1; the caller fans samples out).

    Raises
    ------
    BadRequestError
        A field is out of range; the message names it and says what is allowed.
    """
    from pagedcore.engine.sampling.sampling_params import SamplingParams

    max_tokens, max_field = body.max_tokens, "max_tokens"
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        max_tokens, max_field = body.max_completion_tokens, "max_completion_tokens"
    # The most a prompt leaves (at least one token: the last one sampled needs no KV slot).
    room = max(1, limits.max_model_len - num_prompt_tokens)
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room and num_prompt_tokens <= limits.max_model_len:
        # (A prompt too long by itself is refused with its own message, naming both numbers.)
        raise BadRequestError(
            f"{max_field} is too large: {max_tokens}. This model's maximum context length is "
            f"{limits.max_model_len} tokens and the prompt has {num_prompt_tokens}, so at most "
            f"{room} can be generated; lower {max_field} (or leave it out to generate up to the "
            "model length), or shorten the prompt", param=max_field,
            code="context_length_exceeded")
    if isinstance(body, CompletionRequest) and body.echo_only:
        max_tokens = 1  # the engine generates one token; the response leaves it out
    checks: Sequence[tuple[bool, str, str]] = (
        (max_tokens >= 1, max_field, f"must be >= 1, got {max_tokens}"
         + (" (0 only with echo: true, to score the prompt)"
            if isinstance(body, CompletionRequest) else "")),
        (1 <= body.n <= limits.max_n, "n", f"must be in [1, {limits.max_n}], got {body.n}"),
        (body.temperature is None or 0.0 <= body.temperature, "temperature",
         f"must be >= 0 (0 = greedy), got {body.temperature}"),
        (body.top_p is None or 0.0 < body.top_p <= 1.0, "top_p",
         f"must be in (0, 1], got {body.top_p}"),
        (body.min_p is None or 0.0 <= body.min_p <= 1.0, "min_p",
         f"must be in [0, 1], got {body.min_p}"),
        (body.top_k is None or body.top_k == -1 or body.top_k >= 0, "top_k",
         f"must be -1 or 0 (all tokens) or a positive integer, got {body.top_k}"),
        (num_logprobs is None or 0 <= num_logprobs <= MAX_LOGPROBS,
         "top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs",
         f"must be in [0, {MAX_LOGPROBS}], got {num_logprobs}"),
        (len(body.stop_strings()) <= 16, "stop", "at most 16 stop strings"),
        (prompt_logprobs is None or 0 <= prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs",
         f"must be in [0, {MAX_LOGPROBS}], got {prompt_logprobs}"),
    )
    for ok, field, what in checks:
        if not ok:
            raise BadRequestError(f"{field} {what}", param=field, code="invalid_value")
    top_k = body.top_k if body.top_k not in (0, -1) else None
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=top_k,
            min_p=0.0 if body.min_p is None else body.min_p,
            seed=body.seed,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            logprobs=num_logprobs,
            prompt_logprobs=prompt_logprobs,
            stop=tuple(body.stop_strings()),
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            spaces_between_special_tokens=body.spaces_between_special_tokens,
            min_tokens=body.min_tokens,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=(1.0 if body.repetition_penalty is None
                                else body.repetition_penalty),
            logit_bias=(None if body.logit_bias is None  # JSON keys are strings
                        else {int(k) if k.strip().isdecimal() else k: v  # type: ignore[misc]
                              for k, v in body.logit_bias.items()}),
            bad_words=tuple(body.bad_words or ()),
            allowed_token_ids=(None if body.allowed_token_ids is None
                               else tuple(body.allowed_token_ids)),
        )
    except ValueError as exc:
        raise BadRequestError(str(exc), param=_param_of(exc, body), code="invalid_value") \
            from exc
    if limits.vocab_size is not None:
        from pagedcore.engine.request_checks import token_fields_outside

        for field, bad in token_fields_outside(params, limits.vocab_size):
            raise BadRequestError(f"{field} has token ids {bad[:5]} outside the vocabulary "
                                  f"[0, {limits.vocab_size})", param=field,
                                  code="invalid_value")
    return params
