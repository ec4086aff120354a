"""What the engine hands back: per-request outputs with timing metrics."""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["CompletionOutput", "Logprob", "RequestMetrics", "RequestOutput"]


class Logprob(float):
    """The log-probability of one token at one position (vLLM's `Logprob`).

    It is the float itself (so ``entry[token] - other`` and ``float(entry[token])`` keep
    working for code that read plain floats), with vLLM's attributes.

    Attributes
    ----------
    logprob:
        log-softmax of the raw model logits (the float value).
    rank:
        1 for the most likely token, 2 for the next, ...; None when unknown.
    decoded_token:
        The token's text (decoded alone), or None without a tokenizer.
    """

    __slots__ = ("decoded_token", "rank")
    rank: int | None
    decoded_token: str | None

    def __new__(cls, logprob: float, rank: int | None = None,
                decoded_token: str | None = None) -> Logprob:
        self = super().__new__(cls, logprob)
        self.rank = rank
        self.decoded_token = decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return (f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, "
                f"decoded_token={self.decoded_token!r})")

    def __reduce__(self) -> tuple[Any, ...]:
        return (Logprob, (float(self), self.rank, self.decoded_token))


@attrs.define(kw_only=True)
class RequestMetrics:
    """Wall-clock timestamps (``time.perf_counter`` seconds) and counters of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first generated token, or None before it exists."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@attrs.define(kw_only=True)
class CompletionOutput:
    """One sample of a request.

    Attributes
    ----------
    index:
        Which of the request's `n` samples this is.
    token_ids:
        Generated token ids (the prompt excluded).
    text:
        Decoded `token_ids` when a tokenizer is available, else "" (incrementally; special
        tokens left out unless ``skip_special_tokens=False``; cut at a stop string). In a delta
        output (`LLM.stream`) the new text only, as `token_ids` are the new ids only.
    logprobs:
        Per generated token, ``{token_id: Logprob}`` of the top tokens and the sampled one, or
        None when not requested.
    cumulative_logprob:
        Sum of the sampled tokens' logprobs (all tokens so far, also in a delta output), or
        None when logprobs were not requested.
    finish_reason:
        "length" (max_tokens or max_model_len), "stop" (EOS, a stop token or a stop string),
        "abort", "error" (the step computing it failed; see `RequestOutput.error`), or None
        while running.
    stop_reason:
        With "stop": the EOS or stop token id, or the stop string, that ended the sample.
    """

    index: int
    token_ids: list[int]
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@attrs.define(kw_only=True)
class RequestOutput:
    """The state of one request (all its samples) after a step or at the end.

    Attributes
    ----------
    request_id:
        The id given to `add_request` (or assigned by `generate`).
    prompt:
        The prompt text, or None when it was given as token ids.
    prompt_token_ids:
        The prompt's token ids.
    outputs:
        One `CompletionOutput` per sample, by index.
    finished:
        True once every sample has finished.
    num_cached_tokens:
        Prompt tokens served from the prefix cache when the request was first scheduled
        (the largest over its samples).
    metrics:
        Timing of the request (of sample 0 when n > 1, with the latest finish time).
    error:
        Why the engine gave up on the request (it could never be scheduled, or a step computing
        it failed: then the exception's type and message), else None.
    sampling_defaults:
        The sampling fields taken from the checkpoint's ``generation_config`` because the
        request gave no `SamplingParams` (``{}`` when none were).
    delta:
        True when `outputs` hold only what is new since the request's previous output.
    prompt_logprobs:
        With ``SamplingParams.prompt_logprobs``: one entry per prompt token, ``None`` for the
        first, then ``{token_id: Logprob}`` of the top tokens and the prompt token itself
        (always present, with its true rank), from the logits of the position before it.
        None when not requested, and while the prompt is still being computed; a delta
        output carries them once, in the first output after the prompt.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    error: str | None = None
    sampling_defaults: dict[str, Any] = attrs.Factory(dict)
    delta: bool = False
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
