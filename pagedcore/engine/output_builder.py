"""Prompts in, `RequestOutput`s out: the request-level bookkeeping around the scheduler.

A user request (one prompt) becomes `n` scheduler `Request`s, one per sample; `ParentRequest`
groups them again and `build_output` folds their state into one `RequestOutput`.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from pagedcore.engine.detokenizer import TextState, advance_text
from pagedcore.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pagedcore.engine.sampling.sampling_params import SamplingParams
from pagedcore.engine.scheduling.request import (
    FINISHED_VALUES,
    FinishReason,
    Request,
    finish_reason_of_value,
)
from pagedcore.engine.validation import (
    MAX_SEED,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    as_index,
    describe,
)

__all__ = [
    "DELTA_FIELDS", "ParentRequest", "PromptType", "build_output", "delta_fields", "make_children",
    "normalize_prompts", "plain_outputs", "tokenize", "tokenize_packed", "update_texts",
]

#: Text (needs a tokenizer), token ids, or ``{"prompt_token_ids": [...]}`` /
#: ``{"prompt": "..."}`` as in vLLM.
PromptType = str | Sequence[int] | Mapping[str, Any]

_LITTLE_ENDIAN = sys.byteorder == "little"


class ParentRequest:
    """A user request: one prompt, `n` child sequences (and their text, by sample index)."""

    __slots__ = ("children", "delta", "logprobs", "prompt", "prompt_logprobs",
                 "prompt_logprobs_sent", "prompt_token_ids", "request_id", "sampling_defaults",
                 "sent", "texts")

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 *, sampling_defaults: dict[str, Any] | None = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.children: list[Request] = []
        #: Per sample, its detokenizer and stop strings (None without a tokenizer).
        self.texts: list[TextState | None] = []
        #: Per sample, (tokens, characters) already handed out in delta outputs.
        self.sent: list[tuple[int, int]] = []
        #: Per sample, its logprobs as `Logprob` objects and their running sum (each
        #: position converted once, however many outputs are built).
        self.logprobs: list[tuple[list[dict[int, Logprob]], list[float]]] = []
        #: The `SamplingParams` fields taken from the checkpoint's generation_config.
        self.sampling_defaults = sampling_defaults or {}
        #: Build delta outputs (what is new since the previous output), as `LLM.stream` does.
        self.delta = False
        #: The prompt logprobs as `Logprob` objects once all are computed (None before).
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        #: A delta output carried `prompt_logprobs` already (they are sent once).
        self.prompt_logprobs_sent = False


_PROMPT_FORMS = "a str, a list of token ids, or a dict with 'prompt' or 'prompt_token_ids'"


def _prompt_error(message: str, *, type_error: bool = True) -> InvalidArgumentError:
    cls = InvalidArgumentTypeError if type_error else InvalidArgumentError
    return cls(f"invalid prompt: {message}")


def _token_ids(prompt: Any, vocab_size: int, *, name: str = "prompt") -> list[int]:
    """The ids of a token-id prompt, checked by type (true ints only) and range."""
    return _checked_ids(prompt, vocab_size, name=name)[0]


def _checked_ids(
    prompt: Any, vocab_size: int, *, name: str = "prompt"
) -> tuple[list[int], bytes | None]:
    """`_token_ids`, and the ids packed as little-endian int64 when the check packed them
    (a prompt of exact ints on a little-endian host; else None)."""
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise _prompt_error(
            f"{name} is raw {type(prompt).__name__}; pass text (decode the bytes) or a list "
            "of token ids"
        )
    array_like = getattr(prompt, "ndim", None) == 1  # a 1-D numpy array or torch tensor
    if isinstance(prompt, (str, Mapping)) or not (isinstance(prompt, Sequence) or array_like):
        raise _prompt_error(f"{name} must be {_PROMPT_FORMS}, got {describe(prompt)}")
    if array_like and "bool" in str(getattr(prompt, "dtype", "")):
        # (Its elements have __index__, so the element check below would take them as 0/1.)
        raise _prompt_error(f"token ids must be ints, got a {type(prompt).__name__} of bools "
                            f"as {name}")
    ids: list[int]
    # At C speed (a prompt's ids are checked inside its time to first token): every element
    # an exact int (counting a list of types is ~1.6x faster than building their set).
    if list(map(type, prompt)).count(int) == len(prompt):
        try:
            packed = array("q", prompt)
        except OverflowError:
            ids = list(prompt)
        else:
            import numpy as np

            view = np.frombuffer(packed, dtype=np.int64)
            # Exact ints already: a shallow copy (no new int objects, ~10x a tolist()).
            ids = list(prompt)
            if ids and 0 <= int(view.min()) and int(view.max()) < vocab_size:
                # (The prefix-cache hashes reuse the packed ids: `Request.prompt_bytes`.)
                return ids, packed.tobytes() if _LITTLE_ENDIAN else None
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
    return ids, None


def tokenize(
    prompt: PromptType, *, tokenizer: Any, model_name: str, vocab_size: int,
    no_tokenizer_reason: str | None = None,
) -> tuple[str | None, list[int]]:
    """The text (None when given as ids) and the token ids of `prompt` (raises as
    `tokenize_packed`)."""
    text, ids, _ = tokenize_packed(prompt, tokenizer=tokenizer, model_name=model_name,
                                   vocab_size=vocab_size, no_tokenizer_reason=no_tokenizer_reason)
    return text, ids


def tokenize_packed(
    prompt: PromptType, *, tokenizer: Any, model_name: str, vocab_size: int,
    no_tokenizer_reason: str | None = None,
) -> tuple[str | None, list[int], bytes | None]:
    """The text (None when given as ids), the token ids of `prompt`, and the ids packed as
    little-endian int64 when the check packed them (else None; for `Request.prompt_bytes`).

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
            ids, packed = _checked_ids(prompt["prompt_token_ids"], vocab_size,
                                       name="'prompt_token_ids'")
            return text, ids, packed
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
            why = f" ({no_tokenizer_reason})" if no_tokenizer_reason else ""
            raise ValueError(
                f"model {model_name!r} has no tokenizer{why}; pass token ids instead of text"
            )
        if not prompt:
            raise _prompt_error("the prompt text is empty", type_error=False)
        ids, packed = _checked_ids(list(tokenizer.encode(prompt)), vocab_size,
                                   name="the tokenizer's output")
        return prompt, ids, packed
    return None, *_checked_ids(prompt, vocab_size)


def make_children(
    parent: ParentRequest,
    params: SamplingParams,
    *,
    arrivals: Iterator[int],
    eos_token_ids: Sequence[int],
    now: float,
    tokenizer: Any = None,
    bad_words_token_ids: Sequence[Sequence[int]] = (),
    prompt_bytes: bytes | None = None,
) -> list[Request]:
    """One scheduler `Request` per sample of `parent` (added to ``parent.children``).

    With ``n == 1`` the child keeps the parent's id, else sample i is ``"<id>#i"``; a seeded
    request gives sample i the seed ``seed + i`` so the samples differ yet stay reproducible.
    Only sample 0 computes the prompt logprobs (they are the same for every sample; the
    others may take the prompt's blocks from the prefix cache). `prompt_bytes`: the prompt's
    ids packed as little-endian int64 (`tokenize_packed`), shared by every sample.
    """
    for i in range(params.n):
        child_params = params
        if params.n > 1 and params.seed is not None:
            # Wrapped into the seed range (seed 2**64 - 1 with n > 1 stays valid).
            child_params = params.replace(seed=(params.seed + i) % (MAX_SEED + 1))
        if i > 0 and params.prompt_logprobs is not None:
            child_params = child_params.replace(prompt_logprobs=None)
        child_id = parent.request_id if params.n == 1 else f"{parent.request_id}#{i}"
        child = Request(
            child_id,
            parent.prompt_token_ids,
            child_params,
            arrival_index=next(arrivals),
            eos_token_ids=eos_token_ids,
            sample_index=i,
            arrival_time=now,
            checked=True,
            prompt_bytes=prompt_bytes,
        )
        child.bad_words_token_ids = [list(w) for w in bad_words_token_ids]
        parent.children.append(child)
        parent.texts.append(None if tokenizer is None else TextState(tokenizer, child_params))
        parent.sent.append((0, 0))
        parent.logprobs.append(([], [0.0]))
    return parent.children


def normalize_prompts(
    prompts: PromptType | Sequence[PromptType],
    sampling_params: SamplingParams | Sequence[SamplingParams] | None,
) -> tuple[list[PromptType], list[SamplingParams | None]]:
    """One prompt or a list, with one `SamplingParams` for all or one each -> paired lists
    (None: the engine's defaults)."""
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
        # None stays None: the engine's defaults (its generation_config) apply.
        params_list: list[SamplingParams | None] = [sampling_params] * len(prompt_list)
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


def _convert(entry: dict[int, float], token_id: int, tokenizer: Any) -> dict[int, Logprob]:
    """One position's ``{token: logprob}`` as `Logprob` objects, most likely first; the
    sampled token keeps the sampler's rank (it may lie outside the top ones)."""
    ordered = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)
    sampled_rank = getattr(entry, "rank", None)
    out = {}
    for position, (t, lp) in enumerate(ordered):
        rank = int(sampled_rank) if t == token_id and sampled_rank is not None else position + 1
        out[t] = Logprob(lp, rank, None if tokenizer is None else tokenizer.decode([t]))
    return out


def _logprobs(
    parent: ParentRequest, child: Request, tokenizer: Any, start: int
) -> tuple[list[dict[int, Logprob]] | None, float | None]:
    """The child's logprobs from generated token `start` on, and their cumulative sum."""
    if child.logprobs is None:
        return None, None
    done, total = parent.logprobs[child.sample_index]
    tokens = child.output_token_ids
    for i in range(len(done), len(child.logprobs)):
        entry = _convert(child.logprobs[i], tokens[i], tokenizer)
        done.append(entry)
        total[0] += float(entry.get(tokens[i], 0.0))
    return done[start:], total[0]


def _prompt_logprobs(
    parent: ParentRequest, tokenizer: Any, *, delta: bool
) -> list[dict[int, Logprob] | None] | None:
    """``[None, {token: Logprob}, ...]`` (one entry per prompt token) once sample 0 has them
    all, else None; a delta output carries them once."""
    first = parent.children[0]
    entries = first.prompt_logprobs
    if entries is None or first.needs_prompt_logprobs:
        return None
    if parent.prompt_logprobs is None:
        prompt = first.prompt_token_ids
        parent.prompt_logprobs = [None] + [
            _convert(entry, prompt[i + 1], tokenizer) for i, entry in enumerate(entries)]
    if delta:
        if parent.prompt_logprobs_sent:
            return None
        parent.prompt_logprobs_sent = True
    return parent.prompt_logprobs


def update_texts(parent: ParentRequest) -> None:
    """Detokenize what each sample generated since the last call (a no-op without a
    tokenizer); a sample whose text matched a stop string gets it as ``stop_reason``."""
    for child, state in zip(parent.children, parent.texts, strict=True):
        if state is None:
            continue
        finished = child.status._value_ in FINISHED_VALUES
        advance_text(state, child._all_token_ids, finished=finished,
                     offset=child._num_prompt_tokens)
        if finished and state.matcher.matched is not None:
            child.stop_reason = state.matcher.matched


# Outputs are built per running request per step: `plain_outputs` allocates them and sets
# their fields directly, without the class call (which packs the keywords into a dict for
# the attrs ``__init__``): about half the time. It sets every field, in `attrs.fields`
# order (tests/engine/test_host_path.py checks that these lists match the classes).
_COMPLETION_FIELDS = ("index", "token_ids", "text", "logprobs", "cumulative_logprob",
                      "finish_reason", "stop_reason")
_REQUEST_OUTPUT_FIELDS = ("request_id", "prompt", "prompt_token_ids", "outputs", "finished",
                          "num_cached_tokens", "metrics", "error", "sampling_defaults", "delta",
                          "prompt_logprobs")
_new_request_output = RequestOutput.__new__
_new_completion = CompletionOutput.__new__
# (`build_output`'s general path: the attrs ``__init__`` called directly, no keyword dict.)
_init_request_output = RequestOutput.__init__
_init_completion = CompletionOutput.__init__


def _plain_output(parent: ParentRequest) -> RequestOutput:
    """`build_output` of a parent with one sample and no text, logprobs, prompt logprobs or
    error (see `plain_outputs`)."""
    outputs, _others, _finished = plain_outputs([parent], errors={})
    out = outputs[0]
    assert out is not None
    return out


def plain_outputs(
    parents: Sequence[ParentRequest], *, errors: dict[str, str]
) -> tuple[list[RequestOutput | None], list[int], list[ParentRequest]]:
    """`build_output(parent, tokenizer=None, errors=errors)` of each of `parents` that is
    plain (one sample; no delta, logprobs, prompt logprobs or error), in one loop (the
    common case, once per running request per step: kept to attribute reads and writes).

    Returns
    -------
    tuple
        The outputs in the order of `parents`, None for each parent that is not plain (build
        those with `build_output`); the indexes of those; the plain parents whose output is
        finished.
    """
    outputs: list[RequestOutput | None] = []
    append = outputs.append
    others: list[int] = []
    finished: list[ParentRequest] = []
    reason_of = finish_reason_of_value
    new_output, new_completion = _new_request_output, _new_completion
    for parent in parents:
        children = parent.children
        if not parent.delta and len(children) == 1:
            child = children[0]
            if (child.logprobs is None and child.prompt_logprobs is None
                    and not (errors and child.request_id in errors)):
                reason = reason_of(child.status._value_)
                completion = new_completion(CompletionOutput)
                completion.index = child.sample_index
                completion.token_ids = child._all_token_ids[child._num_prompt_tokens:]
                completion.text = ""
                completion.logprobs = None
                completion.cumulative_logprob = None
                out = new_output(RequestOutput)
                out.request_id = parent.request_id
                out.prompt = parent.prompt
                out.prompt_token_ids = parent.prompt_token_ids
                out.outputs = [completion]
                if reason is None:
                    completion.finish_reason = completion.stop_reason = None
                    out.finished = False
                else:
                    completion.finish_reason = reason._value_
                    completion.stop_reason = child.stop_reason
                    out.finished = True
                    finished.append(parent)
                out.num_cached_tokens = child.num_cached_tokens or 0
                out.metrics = child.metrics
                out.error = None
                defaults = parent.sampling_defaults
                out.sampling_defaults = dict(defaults) if defaults else {}
                out.delta = False
                out.prompt_logprobs = None
                append(out)
                continue
        others.append(len(outputs))
        append(None)
    return outputs, others, finished


#: The fields of a raw delta (`delta_fields`), in order; `pagedcore.serve.deltas.StreamDelta`
#: has the same fields in the same order.
DELTA_FIELDS = ("request_id", "text", "token_ids", "logprobs", "finish_reason", "stop_reason",
                "num_prompt_tokens", "num_cached_tokens", "num_generated_tokens",
                "prompt_logprobs")


def delta_fields(
    parents: Sequence[ParentRequest], *, tokenizer: Any, errors: dict[str, str],
    out: list[tuple[Any, ...]],
) -> list[ParentRequest]:
    """`build_output(parent, delta=True)` of each of `parents` as a plain tuple of
    `DELTA_FIELDS`, appended to `out`, without the `RequestOutput` and `CompletionOutput`
    objects, for the common streaming case: one sample, no logprobs, no prompt logprobs, no
    error. Returns the parents that are not that case (build their outputs with
    `build_output`).

    A server streaming hundreds of requests needs one per running request per step, so this
    loop is kept to attribute reads (~1 us a request): the same text, tokens and finish reason
    as `build_output`, ``parent.sent`` updated the same way.
    """
    rest: list[ParentRequest] = []
    append = out.append
    error = FinishReason.ERROR
    reason_of = finish_reason_of_value
    for parent in parents:
        children = parent.children
        if len(children) != 1:
            rest.append(parent)
            continue
        child = children[0]
        if (child.logprobs is not None or child.prompt_logprobs is not None
                or (errors and child.request_id in errors)):
            rest.append(parent)
            continue
        reason = reason_of(child.status._value_)
        if reason is error:
            rest.append(parent)
            continue
        all_ids = child._all_token_ids
        num_prompt = child._num_prompt_tokens
        stop_reason = child.stop_reason
        sent_tokens, sent_chars = parent.sent[0]
        state = parent.texts[0] if tokenizer is not None else None
        num_generated = len(all_ids) - num_prompt
        if state is None:
            text = ""
            parent.sent[0] = (num_generated, 0)
        else:
            finished = reason is not None
            advance_text(state, all_ids, finished=finished, offset=num_prompt)
            if state.stop_string is not None:
                if finished:
                    child.stop_reason = stop_reason = state.stop_string
                if reason is FinishReason.STOP or reason is FinishReason.LENGTH:
                    reason, stop_reason = FinishReason.STOP, state.stop_string
            full = state.text
            parent.sent[0] = (num_generated, len(full))
            text = full[sent_chars:] if sent_chars else full
        append((parent.request_id, text, all_ids[num_prompt + sent_tokens:], None,
                None if reason is None else reason._value_,
                None if reason is None else stop_reason, num_prompt,
                child.num_cached_tokens or 0, num_generated, None))
    return rest


def build_output(
    parent: ParentRequest, *, tokenizer: Any, errors: dict[str, str], delta: bool = False
) -> RequestOutput:
    """The `RequestOutput` of `parent` now; pops its children's entries from `errors`.

    ``delta=True``: each sample's tokens, text and logprobs since its previous delta output.
    ``tokenizer=None`` (also the fallback when decoding failed): no text.
    """
    children = parent.children
    if tokenizer is None and not delta and len(children) == 1:
        child = children[0]
        if (child.logprobs is None and child.prompt_logprobs is None
                and child.request_id not in errors):
            return _plain_output(parent)
    if tokenizer is not None:
        update_texts(parent)
    children = parent.children
    completions = []
    # Built once per running request per step when streaming: kept lean (no copy of the
    # whole output, nothing computed that the request did not ask for).
    for child in children:
        i = child.sample_index
        all_ids = child._all_token_ids
        num_prompt = child._num_prompt_tokens
        state = parent.texts[i] if tokenizer is not None else None
        text = "" if state is None else state.text
        reason = finish_reason_of_value(child.status._value_)
        stop_reason = child.stop_reason
        if state is not None and state.matcher.matched is not None and reason in (
                FinishReason.STOP, FinishReason.LENGTH):
            # Matched in the step that also ended it by length: the stop string wins (vLLM).
            reason, stop_reason = FinishReason.STOP, state.stop_string
        sent_tokens, sent_chars = parent.sent[i] if delta else (0, 0)
        logprobs, cumulative = (None, None) if child.logprobs is None else _logprobs(
            parent, child, tokenizer, sent_tokens)
        if delta:
            parent.sent[i] = (len(all_ids) - num_prompt, len(text))
        completion = _new_completion(CompletionOutput)
        _init_completion(
            completion,
            index=i,
            token_ids=all_ids[num_prompt + sent_tokens:],
            text=text[sent_chars:] if sent_chars else text,
            logprobs=logprobs,
            cumulative_logprob=cumulative,
            finish_reason=None if reason is None else reason._value_,
            stop_reason=stop_reason if reason is not None else None,
        )
        completions.append(completion)
    first = children[0]
    metrics = first.metrics
    if len(children) == 1:
        finished = first.status._value_ in FINISHED_VALUES
        num_cached = first.num_cached_tokens or 0
    else:
        finished = all(c.status.finished for c in children)
        num_cached = max(c.num_cached_tokens or 0 for c in children)
        ends = [c.metrics.finished_time for c in children]
        if finished and all(e is not None for e in ends):
            metrics.finished_time = max(e for e in ends if e is not None)
    found = [errors.pop(c.request_id) for c in children if c.request_id in errors] \
        if errors else None
    out = _new_request_output(RequestOutput)
    _init_request_output(
        out,
        request_id=parent.request_id,
        prompt=parent.prompt,
        prompt_token_ids=parent.prompt_token_ids,
        outputs=completions,
        finished=finished,
        num_cached_tokens=num_cached,
        metrics=metrics,
        error=found[0] if found else None,
        sampling_defaults=dict(parent.sampling_defaults) if parent.sampling_defaults else {},
        delta=delta,
        prompt_logprobs=None if first.prompt_logprobs is None
        else _prompt_logprobs(parent, tokenizer, delta=delta),
    )
    return out
