"""Prompts in, `RequestOutput`s out: the request-level bookkeeping around the scheduler.

A user request (one prompt) becomes `n` scheduler `Request`s, one per sample; `ParentRequest`
groups them again and `build_output` folds their state into one `RequestOutput`.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from pagedcore.engine.outputs import CompletionOutput, RequestOutput
from pagedcore.engine.sampling.sampling_params import SamplingParams
from pagedcore.engine.scheduling.request import Request
from pagedcore.engine.validation import (
    MAX_SEED,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    as_index,
    describe,
)

__all__ = [
    "ParentRequest", "PromptType", "build_output", "make_children", "normalize_prompts", "tokenize",
]

#: Text (needs a tokenizer), token ids, or ``{"prompt_token_ids": [...]}`` /
#: ``{"prompt": "..."}`` as in vLLM.
PromptType = str | Sequence[int] | Mapping[str, Any]


class ParentRequest:
    """A user request: one prompt, `n` child sequences."""

    __slots__ = ("children", "prompt", "prompt_token_ids", "request_id")

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int]) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.children: list[Request] = []


_PROMPT_FORMS = "a str, a list of token ids, or a dict with 'prompt' or 'prompt_token_ids'"


def _prompt_error(message: str, *, type_error: bool = True) -> InvalidArgumentError:
    cls = InvalidArgumentTypeError if type_error else InvalidArgumentError
    return cls(f"invalid prompt: {message}")


def _token_ids(prompt: Any, vocab_size: int, *, name: str = "prompt") -> list[int]:
    """The ids of a token-id prompt, checked by type (true ints only) and range."""
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise _prompt_error(
            f"{name} is raw {type(prompt).__name__}; pass text (decode the bytes) or a list "
            "of token ids"
        )
    array_like = getattr(prompt, "ndim", None) == 1  # a 1-D numpy array or torch tensor
    if isinstance(prompt, (str, Mapping)) or not (isinstance(prompt, Sequence) or array_like):
        raise _prompt_error(f"{name} must be {_PROMPT_FORMS}, got {describe(prompt)}")
    ids: list[int]
    if set(map(type, prompt)) <= {int}:
        # At C speed (a prompt's ids are checked inside its time to first token).
        try:
            packed = array("q", prompt)
        except OverflowError:
            ids = list(prompt)
        else:
            import numpy as np

            view = np.frombuffer(packed, dtype=np.int64)
            ids = packed.tolist()
            if ids and 0 <= int(view.min()) and int(view.max()) < vocab_size:
                return ids
    else:
        ids = []
        for t in prompt:
            as_int = as_index(t)
            if as_int is None:
                raise _prompt_error(
                    f"token ids must be ints, got an element {describe(t)} in {name}"
                )
            ids.append(as_int)
    if not ids:
        raise _prompt_error(f"{name} is empty; give at least one token", type_error=False)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise _prompt_error(
            f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})", type_error=False
        )
    return ids


def tokenize(
    prompt: PromptType, *, tokenizer: Any, model_name: str, vocab_size: int
) -> tuple[str | None, list[int]]:
    """The text (None when given as ids) and the token ids of `prompt`.

    Raises
    ------
    InvalidArgumentError
        (a ValueError; also a TypeError for a wrong type) Text without a tokenizer, a dict
        with neither key or a non-str ``"prompt"``, raw bytes, ids that are not ints (floats,
        bools) or outside ``[0, vocab_size)``, or an empty prompt.
    """
    if isinstance(prompt, Mapping):
        if "prompt_token_ids" in prompt:
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise _prompt_error(f"'prompt' must be a str or absent, got {describe(text)}")
            ids = _token_ids(prompt["prompt_token_ids"], vocab_size, name="'prompt_token_ids'")
            return text, ids
        if "prompt" not in prompt:
            raise _prompt_error(
                f"a prompt dict needs 'prompt_token_ids' or 'prompt', got keys {sorted(prompt)}",
                type_error=False,
            )
        prompt = prompt["prompt"]
        if not isinstance(prompt, str):
            raise _prompt_error(f"'prompt' must be a str, got {describe(prompt)}")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(
                f"model {model_name!r} has no tokenizer; pass token ids instead of text"
            )
        if not prompt:
            raise _prompt_error("the prompt text is empty", type_error=False)
        return prompt, _token_ids(list(tokenizer.encode(prompt)), vocab_size,
                                  name="the tokenizer's output")
    return None, _token_ids(prompt, vocab_size)


def make_children(
    parent: ParentRequest,
    params: SamplingParams,
    *,
    arrivals: Iterator[int],
    eos_token_id: int | None,
    now: float,
) -> list[Request]:
    """One scheduler `Request` per sample of `parent` (added to ``parent.children``).

    With ``n == 1`` the child keeps the parent's id, else sample i is ``"<id>#i"``; a seeded
    request gives sample i the seed ``seed + i`` so the samples differ yet stay reproducible.
    """
    for i in range(params.n):
        child_params = params
        if params.n > 1 and params.seed is not None:
            # Wrapped into the seed range (seed 2**64 - 1 with n > 1 stays valid).
            child_params = params.replace(seed=(params.seed + i) % (MAX_SEED + 1))
        child_id = parent.request_id if params.n == 1 else f"{parent.request_id}#{i}"
        parent.children.append(Request(
            child_id,
            parent.prompt_token_ids,
            child_params,
            arrival_index=next(arrivals),
            eos_token_id=eos_token_id,
            sample_index=i,
            arrival_time=now,
        ))
    return parent.children


def normalize_prompts(
    prompts: PromptType | Sequence[PromptType],
    sampling_params: SamplingParams | Sequence[SamplingParams] | None,
) -> tuple[list[PromptType], list[SamplingParams]]:
    """One prompt or a list, with one `SamplingParams` for all or one each -> paired lists."""
    prompt_list: list[PromptType]
    if prompts is None or isinstance(prompts, (bytes, bytearray)) or not isinstance(
        prompts, (str, Mapping, Sequence)
    ):
        raise _prompt_error(
            f"prompts must be one prompt ({_PROMPT_FORMS}) or a list of them, got "
            f"{describe(prompts)}"
        )
    if isinstance(prompts, (str, Mapping)) or (
        isinstance(prompts, Sequence) and prompts and as_index(prompts[0]) is not None
    ):
        prompt_list = [prompts]  # type: ignore[list-item]
    else:
        prompt_list = list(prompts)  # type: ignore[arg-type]
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        params_list = [sampling_params or SamplingParams()] * len(prompt_list)
    else:
        if not isinstance(sampling_params, Sequence) or isinstance(sampling_params, str):
            raise InvalidArgumentTypeError(
                "sampling_params must be a SamplingParams, a list of them (one per prompt) or "
                f"None, got {describe(sampling_params)}"
            )
        params_list = list(sampling_params)
        if len(params_list) != len(prompt_list):
            raise ValueError(
                f"got {len(params_list)} SamplingParams for {len(prompt_list)} prompts; "
                "pass one, or one per prompt"
            )
    return prompt_list, params_list


def build_output(
    parent: ParentRequest, *, tokenizer: Any, errors: dict[str, str]
) -> RequestOutput:
    """The `RequestOutput` of `parent` now; pops its children's entries from `errors`."""
    completions = []
    for child in parent.children:
        tokens = child.output_token_ids
        text = tokenizer.decode(tokens) if tokenizer is not None else ""
        reason = child.finish_reason
        completions.append(
            CompletionOutput(
                index=child.sample_index,
                token_ids=tokens,
                text=text,
                logprobs=None if child.logprobs is None else list(child.logprobs),
                finish_reason=None if reason is None else reason.value,
            )
        )
    finished = all(c.status.finished for c in parent.children)
    found = [errors.pop(c.request_id) for c in parent.children if c.request_id in errors]
    metrics = parent.children[0].metrics
    if len(parent.children) > 1:
        ends = [c.metrics.finished_time for c in parent.children]
        if finished and all(e is not None for e in ends):
            metrics.finished_time = max(e for e in ends if e is not None)
    return RequestOutput(
        request_id=parent.request_id,
        prompt=parent.prompt,
        prompt_token_ids=parent.prompt_token_ids,
        outputs=completions,
        finished=finished,
        num_cached_tokens=max(c.num_cached_tokens or 0 for c in parent.children),
        metrics=metrics,
        error=found[0] if found else None,
    )
