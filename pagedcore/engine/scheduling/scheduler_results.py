"""What happens after a scheduled step ran: the results half of `Scheduler`.

`SchedulerResults` is a base class of `pagedcore.engine.scheduling.scheduler.Scheduler` holding the
methods that consume a step's outcome: `update_from_output` appends sampled tokens, stops
finished requests (EOS, stop tokens, ``max_tokens``, ``max_model_len``) and frees their
blocks at once; `fail_step` / `fail` finish requests with an error; `abort` stops requests
on demand. The state it works on (queues, request table, stats, blocks) is owned and set up
by `Scheduler`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from pagedcore.engine.scheduling.request import Request, RequestStatus
from pagedcore.engine.scheduling.scheduler_types import (
    DecodeBatch,
    KVManagerLike,
    SchedulerConfig,
    SchedulerOutput,
    SchedulerStats,
)

if TYPE_CHECKING:
    from pagedcore.engine.scheduling.request_blocks import RequestBlocks

__all__ = ["SchedulerResults"]


class SchedulerResults:
    """Token appending, stop conditions, failure and abort for `Scheduler` (a base class of it)."""

    # Set by `Scheduler.__init__`.
    config: SchedulerConfig
    kv: KVManagerLike
    waiting: deque[Request]
    running: list[Request]
    requests: dict[str, Request]
    stats: SchedulerStats
    errors: dict[str, str]
    blocks: RequestBlocks

    if TYPE_CHECKING:

        def _free(self, request: Request) -> None: ...

    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled: dict[str, tuple[int, dict[int, float] | None]],
        *,
        now: float,
        count_back: bool = False,
    ) -> list[Request]:
        """Append sampled tokens, stop finished requests and free their blocks.

        Returns every request whose output changed this step (including ones that finished).

        `count_back` (overlap scheduling): a request already scheduled into the step in flight
        with its sampled token as that step's input has ``num_computed_tokens`` one past the
        tokens it knew; when it finishes now it is counted back by one first, so it registers
        only the KV a step without overlap would have written.
        """
        changed: list[Request] = list(output.rejected)
        items = output.scheduled
        requests = (items.requests if isinstance(items, DecodeBatch)
                    else [item.request for item in items])
        max_model_len = self.config.max_model_len
        get = sampled.get
        # One loop with no call per request but the stop check of the few that may stop (at
        # 256 decoding requests this loop is a large share of a step's host time): the same
        # state as `Request.append_token` and `_stop_status` request by request.
        for request in requests:
            metrics = request.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
            got = get(request.request_id)
            if got is None:
                continue
            token, logprobs = got
            token = int(token)
            ids = request._all_token_ids
            ids.append(token)
            if logprobs is not None and request.logprobs is not None:
                request.logprobs.append(logprobs)
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            changed.append(request)
            params = request.params
            max_tokens = params.max_tokens
            # A superset of what `_stop_status` stops: the token may end it, or its length
            # may (`num_tokens` counts at most one token in flight).
            if (token in request.eos_token_ids or token in params.stop_token_ids
                    or len(ids) + 1 >= max_model_len
                    or (max_tokens is not None
                        and len(ids) - request._num_prompt_tokens >= max_tokens)):
                status = self._stop_status(request, token)
                if status is not None:
                    if count_back and request.num_computed_tokens > len(ids) - 1:
                        request.num_computed_tokens -= 1
                    self.blocks.register_written(request)
                    self._finish(request, status, now=now)
        return changed

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        params = request.params
        if request.num_output_tokens >= params.min_tokens:
            if (not params.ignore_eos and token in request.eos_token_ids) or (
                    token in params.stop_token_ids):
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        max_tokens = params.max_tokens
        if max_tokens is not None and request.num_output_tokens >= max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus, *, now: float) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._free(request)
        request.status = status
        request.metrics.finished_time = now
        self.requests.pop(request.request_id, None)
        self.stats.num_running = len(self.running)
        self.stats.num_waiting = len(self.waiting)

    def stop(self, requests: Iterable[Request], *, now: float) -> None:
        """Finish `requests` as stopped (a stop string matched their text); free their blocks.
        Set each ``request.stop_reason`` first."""
        for request in requests:
            if request.status.finished:
                continue
            self.blocks.register_written(request)
            self._finish(request, RequestStatus.FINISHED_STOPPED, now=now)

    def fail_step(self, output: SchedulerOutput, reason: str, *, now: float) -> list[Request]:
        """Finish every request of a step that failed to run with `FINISHED_ERROR`.

        `schedule()` already counted the step's tokens as computed and the KV manager cached
        the blocks they fill, but the step never wrote them: those cache entries are dropped
        (no later prefix hit may read them) and the requests' blocks freed. Tokens generated
        in earlier steps stay in the requests. Returns the finished requests.
        """
        failed = [item.request for item in output.scheduled
                  if not item.request.status.finished]
        for item in output.scheduled:
            item.request.num_computed_tokens = item.start
            self.kv.uncache_unwritten_blocks(item.request.request_id, item.start)
        self.fail(failed, reason, now=now)
        return failed

    def fail(self, requests: Iterable[Request], reason: str, *, now: float) -> None:
        """Finish `requests` with `FINISHED_ERROR` and `reason` as their error; free blocks."""
        for request in requests:
            if request.status.finished:
                continue
            self._finish(request, RequestStatus.FINISHED_ERROR, now=now)
            self.errors[request.request_id] = reason

    def abort(self, request_ids: Iterable[str] | str, *, now: float) -> list[Request]:
        """Stop requests at once and free their blocks; KeyError for an unknown id."""
        ids: Sequence[str] = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        unknown = [i for i in ids if i not in self.requests]
        if unknown:
            raise KeyError(
                f"cannot abort unknown or already finished request(s) {unknown}; "
                f"{len(self.requests)} request(s) are in the engine"
            )
        aborted = [self.requests[i] for i in ids]
        for request in aborted:
            self._finish(request, RequestStatus.FINISHED_ABORTED, now=now)
        return aborted
