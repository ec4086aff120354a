"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

__all__ = ["SamplingParams"]


def _to_int_tuple(value: Sequence[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value)


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
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_to_int_tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1
    priority: int = 0
    cache_salt: str | None = None

    def __attrs_post_init__(self) -> None:
        problems: list[str] = []
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            problems.append(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0.0:
            problems.append(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < -1
                                       or self.top_k == 0):
            problems.append(
                f"top_k must be None, -1 (disabled) or a positive integer, got {self.top_k!r}"
            )
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0.0 <= self.min_p <= 1.0:
            problems.append(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            problems.append(f"logprobs must be None or an integer >= 0, got {self.logprobs!r}")
        if not isinstance(self.n, int) or self.n < 1:
            problems.append(f"n must be an integer >= 1, got {self.n!r}")
        if any(t < 0 for t in self.stop_token_ids):
            problems.append(f"stop_token_ids must be non-negative, got {self.stop_token_ids}")
        if problems:
            raise ValueError("invalid SamplingParams: " + "; ".join(problems))

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
