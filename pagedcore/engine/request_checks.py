"""Checks of one request at `LLM.add_request`: its params against the engine's bounds, and
the ids of its samples (all are checked before the first is queued)."""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import Any

from pagedcore.engine.sampling.sampling_params import SamplingParams
from pagedcore.engine.scheduling.request import Request
from pagedcore.engine.validation import InvalidArgumentError, InvalidArgumentTypeError, describe

__all__ = [
    "check_request", "check_schedulable", "check_token_fields", "check_unique_ids",
    "token_fields_outside",
]


def check_request(params: Any, *, max_logprobs: int, max_n: int,
                  vocab_size: int | None = None) -> SamplingParams:
    """`params` (None: the defaults) when it is a `SamplingParams` within the engine's bounds.

    Raises
    ------
    InvalidArgumentError
        Not a `SamplingParams`, or ``logprobs`` or ``prompt_logprobs > max_logprobs``, or
        ``n > max_n``, or (given `vocab_size`) ``allowed_token_ids`` or ``logit_bias``
        naming a token id outside ``[0, vocab_size)``.
    """
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        hint = ": build one with SamplingParams(**...)" if isinstance(params, dict) else ""
        raise InvalidArgumentTypeError(
            f"sampling params must be a SamplingParams or None, got {describe(params)}{hint}"
        )
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > max_logprobs:
            raise InvalidArgumentError(
                f"invalid request: {name}={value} exceeds the engine's max_logprobs="
                f"{max_logprobs}; ask for fewer, or raise it with LLM(max_logprobs=...)"
            )
    if params.n > max_n:
        raise InvalidArgumentError(
            f"invalid request: n={params.n} exceeds the engine's max_n={max_n}; ask for fewer "
            "samples, or raise it with LLM(max_n=...)"
        )
    if vocab_size is not None:
        check_token_fields(params, vocab_size)
    return params


def token_fields_outside(params: SamplingParams, vocab_size: int) -> list[tuple[str, list[int]]]:
    """``(field, ids)`` for each of `params`' token-id fields that names ids outside
    ``[0, vocab_size)``: ``allowed_token_ids`` (a mask of only such ids leaves no token to
    sample) and ``logit_bias`` (a bias on no token). ``stop_token_ids`` are not checked: an
    id the model never samples just never stops it."""
    out = []
    for field, ids in (("allowed_token_ids", params.allowed_token_ids or ()),
                       ("logit_bias", tuple(params.logit_bias or ()))):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            out.append((field, bad))
    return out


def check_token_fields(params: SamplingParams, vocab_size: int) -> None:
    """InvalidArgumentError naming the first `token_fields_outside` the vocabulary."""
    for field, bad in token_fields_outside(params, vocab_size):
        raise InvalidArgumentError(
            f"invalid request: {field} has token ids {bad[:5]} outside the vocabulary "
            f"[0, {vocab_size}); use ids of this model's tokenizer"
        )


def check_unique_ids(
    children: Sequence[Request], *in_use: Container[str]
) -> None:
    """ValueError when the id of any sample is already in use (then none is queued)."""
    for child in children:
        if any(child.request_id in ids for ids in in_use):
            raise InvalidArgumentError(
                f"request id {child.request_id!r} (a sample of this request) is already in the "
                "engine; nothing of this request was queued: pick another request id"
            )


def check_schedulable(request: Request) -> None:
    """InvalidArgumentError when the scheduler could not order or hash `request` (its
    priority is no int, its cache salt no str): checked when the scheduler queues it."""
    priority, salt = request.params.priority, request.cache_salt
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidArgumentTypeError(
            f"request {request.request_id!r}: priority must be an int, got {describe(priority)}"
        )
    if salt is not None and not isinstance(salt, str):
        raise InvalidArgumentTypeError(
            f"request {request.request_id!r}: cache_salt must be a str or None, got "
            f"{describe(salt)}"
        )
