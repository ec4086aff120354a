"""From the `SamplingParams` a user gave to those a request runs with (`LLM.add_request`)."""

from __future__ import annotations

from typing import Any

from pagedcore.engine.sampling.sampling_params import SamplingParams
from pagedcore.engine.validation import InvalidArgumentError

__all__ = ["bad_words_token_ids", "default_params", "resolve_max_tokens"]


def default_params(defaults: dict[str, Any]) -> SamplingParams:
    """`SamplingParams` with `defaults` (the checkpoint's generation_config fields) set.

    A value `SamplingParams` refuses (a generation_config with ``top_p=0``, say) is left out:
    the checkpoint's opinion must not make every request fail.
    """
    params = SamplingParams()
    for key, value in defaults.items():
        try:
            params = params.replace(**{key: value})
        except ValueError:
            continue
    return params


def resolve_max_tokens(
    params: SamplingParams, num_prompt_tokens: int, max_model_len: int
) -> SamplingParams:
    """`params` with ``max_tokens=None`` replaced by what fits in `max_model_len`."""
    if params.max_tokens is not None:
        return params
    return params.replace(max_tokens=max(1, max_model_len - num_prompt_tokens))


def bad_words_token_ids(params: SamplingParams, tokenizer: Any) -> list[list[int]]:
    """``params.bad_words`` as token-id sequences: each word as is and after a space (the two
    ways a word-level BPE writes it), without special tokens.

    Raises
    ------
    InvalidArgumentError
        Bad words or stop strings, and the engine has no tokenizer.
    """
    if (params.bad_words or params.stop) and tokenizer is None:
        field = "bad_words" if params.bad_words else "stop"
        raise InvalidArgumentError(
            f"invalid request: {field} needs a tokenizer and this model has none; use "
            "stop_token_ids / logit_bias with token ids instead")
    out: list[list[int]] = []
    for word in params.bad_words:
        for variant in (word, " " + word.lstrip()):
            try:
                ids = list(tokenizer.encode(variant, add_special_tokens=False))
            except TypeError:  # a tokenizer whose encode takes no such flag
                ids = list(tokenizer.encode(variant))
            if ids and ids not in out:
                out.append([int(t) for t in ids])
    return out
