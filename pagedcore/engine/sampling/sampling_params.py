"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

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

__all__ = ["SamplingParams"]


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How to pick the tokens of one request (vLLM names and meanings).

    Attributes
    ----------
    max_tokens:
        New tokens to generate at most (>= 1).
    temperature:
        0 means greedy; otherwise logits are divided by it before sampling.
    top_k:
        Keep the `top_k` most likely tokens; None or -1 keeps all.
    top_p:
        Keep the smallest set of tokens whose probability mass reaches `top_p` (0 < top_p <= 1).
    min_p:
        Drop tokens whose probability is below ``min_p * p_max`` (0 <= min_p <= 1).
    seed:
        Seed of this request's own random generator (reproducible sampling), or None.
    stop_token_ids:
        Generation stops after any of these tokens (the token is kept in the output).
    ignore_eos:
        Keep generating past the model's EOS token.
    logprobs:
        Number of top log-probabilities to return per generated token (the sampled token's
        is always included), or None for none.
    n:
        Parallel samples per prompt; they share the prompt's KV blocks through the prefix cache.
    priority:
        Lower is served first under the "priority" scheduling policy.
    cache_salt:
        Isolates this request's prefix-cache entries from requests with another salt.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1
    priority: int = 0
    cache_salt: str | None = None

    def __attrs_post_init__(self) -> None:
        # Every field is checked by type and value (no silent coercion); the checked values
        # are stored normalised (numpy ints as ints, a stop-token list as a tuple).
        p = Problems()
        fixed: dict[str, Any] = {
            "max_tokens": check_int(p, "max_tokens", self.max_tokens, low=1),
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
            "logprobs": check_int(p, "logprobs", self.logprobs, low=0, allow_none=True),
            "n": check_int(p, "n", self.n, low=1),
            "priority": check_int(p, "priority", self.priority),
        }
        top_k = check_int(p, "top_k", self.top_k, allow_none=True,
                          expected="None, -1 (disabled) or an int >= 1")
        if top_k is not None and (top_k < -1 or top_k == 0):
            p.value(f"top_k must be None, -1 (disabled) or an int >= 1, got {top_k}")
        fixed["top_k"] = top_k
        salt = self.cache_salt
        if isinstance(salt, (bytes, bytearray)):
            p.type(f"cache_salt must be a str or None, got {describe(salt)}: decode it first, "
                   "e.g. cache_salt=salt.decode() (or salt.hex() for binary salts)")
        elif salt is not None and not isinstance(salt, str):
            p.type(f"cache_salt must be a str or None, got {describe(salt)}")
        raise_problems("SamplingParams", p)
        for name, value in fixed.items():
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        """True when the argmax token is taken (temperature 0)."""
        return self.temperature == 0.0

    @property
    def effective_top_k(self) -> int | None:
        """`top_k` with -1 normalised to None."""
        return None if self.top_k in (None, -1) else self.top_k

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with some fields changed (validated again)."""
        return attrs.evolve(self, **changes)
