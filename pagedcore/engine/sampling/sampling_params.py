"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from pagedcore.engine.validation import (
    MAX_SEED,
    Problems,
    check_bool,
    check_int,
    check_int_sequence,
    check_real,
    describe,
    raise_problems,
)

#: Bounds of the additive penalties (as in vLLM and OpenAI).
PENALTY_RANGE = 2.0

__all__ = ["SamplingParams"]


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How to pick the tokens of one request (vLLM names and meanings).

    Attributes
    ----------
    max_tokens:
        New tokens to generate at most (>= 1); None: up to ``max_model_len`` (the prompt
        included).
    temperature:
        0 means greedy; otherwise logits are divided by it before sampling.
    top_k:
        Keep the `top_k` most likely tokens; None, 0 or -1 keeps all.
    top_p:
        Keep the smallest set of tokens whose probability mass reaches `top_p` (0 < top_p <= 1).
    min_p:
        Drop tokens whose probability is below ``min_p * p_max`` (0 <= min_p <= 1).
    seed:
        Seed of this request's own random generator (reproducible sampling), or None.
    stop_token_ids:
        Generation stops after any of these tokens (the token is kept in the output).
    ignore_eos:
        Keep generating past the model's EOS tokens (every id of the checkpoint's
        ``generation_config.eos_token_id`` and the tokenizer's EOS).
    stop:
        Stop strings, matched on the detokenized text (also across token boundaries); the text
        is cut before the match (the token ids are all kept) and `CompletionOutput.stop_reason`
        names the string. A str is one stop string.
    include_stop_str_in_output:
        Keep the matched stop string at the end of the text.
    min_tokens:
        Neither EOS nor `stop_token_ids` can end the request before this many tokens (their
        logits are masked); stop strings still can.
    skip_special_tokens:
        Leave special tokens (EOS, chat markers) out of the text.
    spaces_between_special_tokens:
        With `skip_special_tokens` False: False writes two adjacent special tokens with no space
        between them (the tokenizer's decoder may add one otherwise).
    presence_penalty, frequency_penalty:
        In [-2, 2]: subtracted from the logit of every token already generated, once
        (presence) or once per occurrence (frequency); > 0 discourages repetition.
    repetition_penalty:
        > 0: the logits of tokens in the prompt or the output are divided by it when positive,
        multiplied when negative (1 = off; > 1 discourages repetition).
    logit_bias:
        ``{token_id: bias}`` added to the logits (bias in [-100, 100]), or None.
    bad_words:
        Words never generated: each is tokenized (as is, and after a space), and the last
        token of a word is banned whenever the output ends with its other tokens.
    allowed_token_ids:
        Only these tokens can be generated, or None for all.
    logprobs:
        Number of top log-probabilities to return per generated token (the sampled token's
        is always included), or None for none.
    prompt_logprobs:
        Number of top log-probabilities to return per prompt token (the prompt token's own is
        always included), or None for none (`RequestOutput.prompt_logprobs`). A request that
        asks for them computes its whole prompt (it takes no prefix-cache hit, as in vLLM).
    n:
        Parallel samples per prompt; they share the prompt's KV blocks through the prefix cache.
    priority:
        Lower is served first under the "priority" scheduling policy.
    cache_salt:
        Isolates this request's prefix-cache entries from requests with another salt.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    bad_words: tuple[str, ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    priority: int = 0
    cache_salt: str | None = None
    # `processes_logits`, computed once (the sampler reads it for every row of every step).
    _processes_logits: bool = attrs.field(init=False, default=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        # Every field is checked by type and value (no silent coercion); the checked values
        # are stored normalised (numpy ints as ints, a stop-token list as a tuple).
        p = Problems()
        fixed: dict[str, Any] = {
            "max_tokens": check_int(p, "max_tokens", self.max_tokens, low=1, allow_none=True),
            "temperature": check_real(p, "temperature", self.temperature, low=0.0,
                                      expected="a finite float >= 0 (0 = greedy)"),
            "top_p": check_real(p, "top_p", self.top_p, low=0.0, low_open=True, high=1.0,
                                expected="a float in (0, 1]"),
            "min_p": check_real(p, "min_p", self.min_p, low=0.0, high=1.0,
                                expected="a float in [0, 1]"),
            "seed": check_int(p, "seed", self.seed, low=0, high=MAX_SEED, allow_none=True,
                              expected="an int in [0, 2**64 - 1] or None"),
            "stop_token_ids": check_int_sequence(p, "stop_token_ids", self.stop_token_ids),
            "ignore_eos": check_bool(p, "ignore_eos", self.ignore_eos),
            "stop": _check_strings(p, "stop", self.stop),
            "include_stop_str_in_output": check_bool(p, "include_stop_str_in_output",
                                                     self.include_stop_str_in_output),
            "min_tokens": check_int(p, "min_tokens", self.min_tokens, low=0),
            "skip_special_tokens": check_bool(p, "skip_special_tokens",
                                              self.skip_special_tokens),
            "spaces_between_special_tokens": check_bool(p, "spaces_between_special_tokens",
                                                        self.spaces_between_special_tokens),
            "presence_penalty": check_real(p, "presence_penalty", self.presence_penalty,
                                           low=-PENALTY_RANGE, high=PENALTY_RANGE,
                                           expected="a float in [-2, 2]"),
            "frequency_penalty": check_real(p, "frequency_penalty", self.frequency_penalty,
                                            low=-PENALTY_RANGE, high=PENALTY_RANGE,
                                            expected="a float in [-2, 2]"),
            "repetition_penalty": check_real(p, "repetition_penalty", self.repetition_penalty,
                                             low=0.0, low_open=True,
                                             expected="a float > 0 (1 = off)"),
            "logit_bias": _check_logit_bias(p, self.logit_bias),
            "bad_words": _check_strings(p, "bad_words", self.bad_words),
            "allowed_token_ids": _check_allowed(p, self.allowed_token_ids),
            "logprobs": check_int(p, "logprobs", self.logprobs, low=0, allow_none=True),
            "prompt_logprobs": check_int(p, "prompt_logprobs", self.prompt_logprobs, low=0,
                                         allow_none=True),
            "n": check_int(p, "n", self.n, low=1),
            "priority": check_int(p, "priority", self.priority),
        }
        top_k = check_int(p, "top_k", self.top_k, allow_none=True,
                          expected="None, 0 or -1 (disabled) or an int >= 1")
        if top_k is not None and top_k < -1:
            p.value(f"top_k must be None, 0 or -1 (disabled) or an int >= 1, got {top_k}",
                    "top_k")
        fixed["top_k"] = top_k
        if (self.max_tokens is not None and fixed["min_tokens"] is not None
                and fixed["max_tokens"] is not None and fixed["min_tokens"] > fixed["max_tokens"]):
            p.value(f"min_tokens ({fixed['min_tokens']}) must not exceed max_tokens "
                    f"({fixed['max_tokens']})", "min_tokens")
        salt = self.cache_salt
        if isinstance(salt, (bytes, bytearray)):
            p.type(f"cache_salt must be a str or None, got {describe(salt)}: decode it first, "
                   "e.g. cache_salt=salt.decode() (or salt.hex() for binary salts)",
                   "cache_salt")
        elif salt is not None and not isinstance(salt, str):
            p.type(f"cache_salt must be a str or None, got {describe(salt)}", "cache_salt")
        raise_problems("SamplingParams", p)
        for name, value in fixed.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_processes_logits", (
            self.has_penalties or bool(self.logit_bias) or bool(self.bad_words)
            or self.allowed_token_ids is not None or self.min_tokens > 0))

    @property
    def greedy(self) -> bool:
        """True when the argmax token is taken (temperature 0)."""
        return self.temperature == 0.0

    @property
    def effective_top_k(self) -> int | None:
        """`top_k` with 0 and -1 normalised to None."""
        return None if self.top_k in (None, 0, -1) else self.top_k

    @property
    def has_penalties(self) -> bool:
        """True when a presence, frequency or repetition penalty is on."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def processes_logits(self) -> bool:
        """True when the logits are changed before sampling (penalties, biases, masks)."""
        return self._processes_logits

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with some fields changed (validated again)."""
        return attrs.evolve(self, **changes)


def _check_strings(p: Problems, name: str, value: Any) -> tuple[str, ...] | None:
    """A str (one item) or a list of str, as a tuple (empty strings dropped)."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,) if value else ()
    if isinstance(value, (bytes, bytearray, Mapping)) or not isinstance(value, Sequence):
        p.type(f"{name} must be a str or a list of str, got {describe(value)}", name)
        return None
    bad = [item for item in value if not isinstance(item, str)]
    if bad:
        p.type(f"{name} must be a list of str, got an element {describe(bad[0])}", name)
        return None
    return tuple(item for item in value if item)


def _check_logit_bias(p: Problems, value: Any) -> dict[int, float] | None:
    """``{token_id: bias}`` with int ids >= 0 (numeric strings too, as JSON sends them)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        p.type(f"logit_bias must be a dict {{token_id: bias}} or None, got {describe(value)}",
               "logit_bias")
        return None
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.strip().isdecimal() else key
        token_id = check_int(Problems(), "", token, low=0)
        if token_id is None:
            p.type(f"logit_bias must have token ids (ints >= 0) as keys, got {describe(key)}",
                   "logit_bias")
            return None
        as_float = check_real(Problems(), "", bias, low=-100.0, high=100.0, expected="")
        if as_float is None:
            p.value(f"logit_bias must map each token id to a float in [-100, 100], got "
                    f"{describe(bias)} for token {token_id}", "logit_bias")
            return None
        out[token_id] = as_float
    return out


def _check_allowed(p: Problems, value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    ids = check_int_sequence(p, "allowed_token_ids", value, allow_none=False)
    if ids is not None and not ids:
        p.value("allowed_token_ids must not be empty (None allows every token)",
                "allowed_token_ids")
        return None
    return ids
