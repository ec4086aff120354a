"""Which rows of a step's flattened batch give prompt log-probabilities (`PromptRows`).

A request with ``SamplingParams.prompt_logprobs`` needs, for every prompt token ``j >= 1``, the
logits at position ``j - 1``. Each prefill chunk ``[start, end)`` contributes the positions
``[max(start, done), min(end, P - 1))`` (``done``: the entries the request already has, so a
prefill recomputed after preemption adds none twice; ``P - 1``: the last prompt position
predicts the first generated token, which the sampler handles). The model runner computes
``lm_head`` over exactly these rows (after the sampled rows), nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    import numpy as np
    import torch

    from pagedcore.engine.scheduling.request import Request
    from pagedcore.engine.scheduling.scheduler_types import ScheduledRequest

__all__ = ["PromptRows", "plan_prompt_rows", "prompt_rows_wanted"]


@attrs.frozen(kw_only=True)
class PromptRows:
    """The prompt-logprob rows of one step.

    Attributes
    ----------
    indices:
        ``[Q]`` int64 on the device: rows of the flattened batch, request by request.
    requests:
        The request of each run of rows.
    first_positions:
        Per request, the first position of its run (its entries ``first_positions[i]`` on).
    counts:
        Per request, how many rows it has (``sum(counts) == Q``).
    """

    indices: torch.Tensor
    requests: tuple[Request, ...]
    first_positions: tuple[int, ...]
    counts: tuple[int, ...]

    @property
    def targets(self) -> list[int]:
        """``[Q]`` the prompt token each row's logits score (position + 1)."""
        out: list[int] = []
        for request, first, count in zip(self.requests, self.first_positions, self.counts,
                                          strict=True):
            out.extend(request.all_token_ids[first + 1 : first + 1 + count])
        return out


def _span(item: ScheduledRequest) -> tuple[int, int] | None:
    """``(first position, count)`` of `item`'s prompt-logprob rows, or None."""
    request = item.request
    entries = getattr(request, "prompt_logprobs", None)  # (a TP worker's view has none)
    if entries is None:
        return None
    lo = max(item.start, len(entries))
    hi = min(item.end, request.num_prompt_tokens - 1)
    return (lo, hi - lo) if hi > lo else None


def prompt_rows_wanted(scheduled: Sequence[ScheduledRequest]) -> bool:
    """True when some request of the step gets prompt-logprob rows (never in a
    `DecodeBatch`: its requests compute their last token, past the prompt)."""
    from pagedcore.engine.scheduling.scheduler_types import DecodeBatch

    if isinstance(scheduled, DecodeBatch):
        return False
    return any(_span(item) is not None for item in scheduled)


def plan_prompt_rows(
    order: Sequence[ScheduledRequest], starts: np.ndarray, device: torch.device
) -> PromptRows | None:
    """The prompt-logprob rows of a step laid out in `order` (None: none).

    Parameters
    ----------
    order:
        The step's requests in batch order.
    starts:
        ``[len(order)]`` the batch row of each request's first token (``query_start_loc``).
    """
    requests: list[Request] = []
    firsts: list[int] = []
    counts: list[int] = []
    rows: list[int] = []
    for i, item in enumerate(order):
        span = _span(item)
        if span is None:
            continue
        first, count = span
        base = int(starts[i]) + first - item.start
        requests.append(item.request)
        firsts.append(first)
        counts.append(count)
        rows.extend(range(base, base + count))
    if not requests:
        return None
    import torch

    return PromptRows(
        indices=torch.tensor(rows, dtype=torch.int64, device=device),
        requests=tuple(requests), first_positions=tuple(firsts), counts=tuple(counts),
    )
