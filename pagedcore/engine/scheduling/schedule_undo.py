"""What one `Scheduler.schedule()` changed, and how to put it back when it raised."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import attrs

from pagedcore.engine.scheduling.request import Request, RequestStatus

if TYPE_CHECKING:
    from pagedcore.engine.scheduling.scheduler_types import (
        KVManagerLike,
        ScheduledRequest,
        SchedulerStats,
    )

__all__ = ["RequestFault", "ScheduleUndo", "safe_extreme"]


@attrs.define
class ScheduleUndo:
    """The journal of one `schedule()` call.

    Attributes
    ----------
    stats:
        ``(prompt_tokens, prefix_hit_tokens)`` counters before the call.
    scheduled:
        The step's requests so far, by id.
    rejected:
        Requests finished as unservable so far (and those carried over from a failed call).
    allocated:
        Request id -> ``(request, tokens whose KV is written)`` for every allocation made.
    pending:
        The allocation in progress (it raised when this is set after the call).
    admitted:
        Requests admitted from the waiting queue: ``(request, previous status, previous
        num_cached_tokens)``.
    """

    stats: tuple[int, int]
    scheduled: dict[str, ScheduledRequest] = attrs.field(factory=dict)
    rejected: list[Request] = attrs.field(factory=list)
    allocated: dict[str, tuple[Request, int]] = attrs.field(factory=dict)
    pending: tuple[Request, int] | None = None
    admitted: list[tuple[Request, RequestStatus, int | None]] = attrs.field(factory=list)

    def rollback(
        self,
        *,
        running: list[Request],
        waiting: deque[Request],
        kv: KVManagerLike,
        stats: SchedulerStats,
        free: Callable[[Request], None],
    ) -> list[Request]:
        """Undo the call's effects (see `Scheduler.schedule`); returns the rejected requests
        the next call must report."""
        for item in self.scheduled.values():
            item.request.num_computed_tokens = item.start
        touched = list(self.allocated.values())
        if self.pending is not None:
            touched.append(self.pending)
        # Blocks the step was about to fill are registered in the prefix cache but never
        # written: no later request may hit them.
        for request, valid in touched:
            kv.uncache_unwritten_blocks(request.request_id, valid)
        for request, status, num_cached in reversed(self.admitted):
            if request in running:
                running.remove(request)
            free(request)
            request.status = status
            request.num_computed_tokens = 0
            request.num_cached_tokens = num_cached
            if request not in waiting:
                waiting.appendleft(request)
        if self.pending is not None:
            request = self.pending[0]
            if request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                free(request)  # it held nothing before this allocation
        stats.prompt_tokens, stats.prefix_hit_tokens = self.stats
        return list(self.rejected)


class RequestFault(Exception):
    """Scheduling one request raised (the cause is ``__cause__``): that request fails alone.

    Raised inside `Scheduler.schedule` where a failure can only come from the request itself
    (its priority key, its prefix hashes); `schedule` rolls back, fails it and goes on.
    """

    def __init__(self, request: Request, what: str) -> None:
        super().__init__(f"{what} for request {request.request_id!r}")
        self.request = request
        self.what = what


_ORIGIN = (0, 0)


def safe_extreme(pick: Callable[..., Request], requests: Iterable[Request]) -> Request:
    """``min`` / ``max`` of `requests` by ``priority_key``; a request whose key cannot be
    compared (a priority that is no int) raises `RequestFault` naming it."""
    try:
        return pick(requests, key=_priority_key)
    except Exception as exc:
        for request in requests:
            try:
                request.priority_key < _ORIGIN  # noqa: B015 - the comparison is the test
            except Exception as own:
                raise RequestFault(request, "comparing its priority") from own
        raise exc


def _priority_key(request: Request) -> tuple[int, int]:
    return request.priority_key
