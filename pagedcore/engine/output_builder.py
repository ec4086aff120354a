"""Prompts in, `RequestOutput`s out: the request-level bookkeeping around the scheduler.

A user request (one prompt) becomes `n` scheduler `Request`s, one per sample; `ParentRequest`
groups them again and `build_output` folds their state into one `RequestOutput`.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from pagedcore.engine.outputs import CompletionOutput, RequestOutput
from pagedcore.engine.request import Request
from pagedcore.engine.sampling_params import SamplingParams

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


def tokenize(
    prompt: PromptType, *, tokenizer: Any, model_name: str, vocab_size: int
) -> tuple[str | None, list[int]]:
    """The text (None when given as ids) and the token ids of `prompt`.

    Raises
    ------
    ValueError
        Text without a tokenizer, a dict with neither key, or ids outside ``[0, vocab_size)``.
    """
    if isinstance(prompt, Mapping):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if "prompt" in prompt:
            prompt = str(prompt["prompt"])
        else:
            raise ValueError("a prompt dict needs 'prompt_token_ids' or 'prompt'")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(
                f"model {model_name!r} has no tokenizer; pass token ids instead of text"
            )
        return prompt, [int(t) for t in tokenizer.encode(prompt)]
    try:
        # At C speed (a prompt's ids are checked inside its time to first token).
        packed = array("q", prompt)
    except (TypeError, OverflowError):  # floats, huge ints, ...: the general conversion
        ids = [int(t) for t in prompt]
    else:
        import numpy as np

        view = np.frombuffer(packed, dtype=np.int64)
        ids = packed.tolist()
        if not ids or (0 <= int(view.min()) and int(view.max()) < vocab_size):
            return None, ids
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    return None, ids


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
            child_params = params.replace(seed=params.seed + i)
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
    if isinstance(prompts, (str, Mapping)) or (
        isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
    ):
        prompt_list = [prompts]  # type: ignore[list-item]
    else:
        prompt_list = list(prompts)  # type: ignore[arg-type]
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        params_list = [sampling_params or SamplingParams()] * len(prompt_list)
    else:
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
