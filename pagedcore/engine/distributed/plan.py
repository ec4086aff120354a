"""The step plan rank 0 broadcasts: just enough to rebuild the step's inputs on every rank.

Per scheduled request: its id, where the step starts, the new tokens and the block ids of each
KV-cache group. Workers hold no request state: a plan is complete on its own, so preemption,
prefix hits and aborts need no extra messages. The tensors are rebuilt locally by the same
`InputBatch` code rank 0 runs, so every rank sees identical positions, block tables and slots.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast, overload

import attrs

if TYPE_CHECKING:
    from pagedcore.engine.scheduling.request import Request
    from pagedcore.engine.scheduling.scheduler_types import ScheduledRequest

__all__ = ["PlannedRequest", "StepPlan", "make_plan", "scheduled_from_plan"]


@attrs.frozen
class PlannedRequest:
    """One request's share of a step.

    Attributes
    ----------
    request_id:
        The scheduler's id.
    start:
        Position of the first new token (tokens before it are in the KV cache).
    token_ids:
        The step's new tokens, positions ``[start, start + len(token_ids))``.
    block_ids:
        Per KV-cache group, the request's block ids.
    """

    request_id: str
    start: int
    token_ids: tuple[int, ...]
    block_ids: tuple[tuple[int, ...], ...]


@attrs.frozen
class StepPlan:
    """The whole step, in the scheduler's order; `step` counts plans from 0.

    With overlap scheduling a planned token may be a placeholder (a negative id standing for
    a token the previous step sampled on rank 0's device); `num_sampled_ids` is then how many
    ids that step sampled: rank 0 broadcasts them over the compute group right after the
    plan, and every rank resolves the placeholders from them on its device.

    `decode_graph` is False when rank 0 runs the step without a decode CUDA graph for a reason
    only it knows (a one-token prompt chunk whose logits give prompt logprobs): every rank then
    runs it so, or their collectives would stop meeting.
    """

    step: int
    requests: tuple[PlannedRequest, ...]
    num_sampled_ids: int = 0
    decode_graph: bool = True


def make_plan(
    step: int,
    scheduled: Sequence[ScheduledRequest],
    block_ids: Callable[[str], tuple[list[int], ...]],
    *,
    num_sampled_ids: int = 0,
    decode_graph: bool = True,
) -> StepPlan:
    """The plan of a scheduler step (rank 0); tokens still on the device are placeholders."""
    from pagedcore.engine.scheduling.request import token_slice

    return StepPlan(
        step,
        tuple(
            PlannedRequest(
                s.request.request_id,
                s.start,
                tuple(token_slice(s.request, s.start, s.end)),
                tuple(tuple(g) for g in block_ids(s.request.request_id)),
            )
            for s in scheduled
        ),
        num_sampled_ids,
        decode_graph,
    )


class _TokenWindow:
    """The slice ``[start, end)`` of a token list, all a worker knows of a request: indexed
    like the whole list, by that slice or by one position inside it (decode fast paths)."""

    __slots__ = ("_start", "_tokens")

    def __init__(self, start: int, tokens: tuple[int, ...]) -> None:
        self._start = start
        self._tokens = tokens

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[int, ...]: ...

    def __getitem__(self, index: int | slice) -> int | tuple[int, ...]:
        if isinstance(index, int):
            if not 0 <= index - self._start < len(self._tokens):
                raise IndexError(
                    f"a planned request only holds tokens [{self._start}, "
                    f"{self._start + len(self._tokens)}); asked for position {index}"
                )
            return self._tokens[index - self._start]
        if index.start != self._start or index.stop != self._start + len(self._tokens):
            raise IndexError(
                f"a planned request only holds tokens [{self._start}, "
                f"{self._start + len(self._tokens)}); asked for [{index.start}, {index.stop})"
            )
        return self._tokens


class _PlannedRequestView:
    """Stands in for a `Request` in `InputBatch.prepare` on a worker.

    ``num_tokens`` is one past the step's end, so no row is sampled: workers compute no logits.
    """

    __slots__ = ("_all_token_ids", "all_token_ids", "num_tokens", "request_id")

    def __init__(self, planned: PlannedRequest) -> None:
        self.request_id = planned.request_id
        self.all_token_ids = _TokenWindow(planned.start, planned.token_ids)
        # `get_token_list` (the decode fast paths' attrgetter) reads the private name.
        self._all_token_ids = self.all_token_ids
        self.num_tokens = planned.start + len(planned.token_ids) + 1


def scheduled_from_plan(
    plan: StepPlan,
) -> tuple[list[ScheduledRequest], Callable[[str], tuple[list[int], ...]]]:
    """What a worker passes to `ModelRunner.prepare`: the scheduled requests (none sampled)
    and the block-id lookup."""
    from pagedcore.engine.scheduling.scheduler_types import ScheduledRequest

    blocks = {p.request_id: tuple(list(g) for g in p.block_ids) for p in plan.requests}
    scheduled = [
        ScheduledRequest(cast("Request", _PlannedRequestView(p)), p.start, len(p.token_ids))
        for p in plan.requests
    ]
    return scheduled, blocks.__getitem__
