"""What one `Scheduler.schedule()` changed, and how to put it back when it raised."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

from pagedcore.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from pagedcore.engine.scheduler_types import KVManagerLike, ScheduledRequest, SchedulerStats

__all__ = ["ScheduleUndo"]


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
