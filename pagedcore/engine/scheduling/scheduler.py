"""Continuous-batching scheduler in the vLLM V1 sense.

Each `schedule()` hands a shared token budget to running requests first (oldest first), then to
waiting ones (FCFS or priority). A prompt is chunked when it does not fit the budget (or exceeds
`long_prefill_token_threshold`). When the KV cache has no room, the newest (or lowest-priority)
running request is preempted: its blocks are freed and it is recomputed later, keeping every
token it generated. `update_from_output()` appends sampled tokens and retires finished requests,
freeing their blocks at once (those result methods live in `SchedulerResults`,
`pagedcore.engine.scheduling.scheduler_results`).

Bucket-aware chunking: with ``SchedulerConfig.token_buckets`` set (the token buckets of the
captured mixed-step CUDA graphs), a step is replayed from the graph of the smallest bucket
that holds it, so 512 prompt tokens + 1 decode = 513 tokens would run (and pay for) a larger
bucket. `Scheduler._align_to_bucket` shrinks a *partial* prefill chunk so the step totals
exactly the largest bucket at or below what it would total; a prompt's final chunk is never
shrunk, nor any chunk below half its size (`pagedcore.engine.scheduling.bucket_align`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from pagedcore.engine.request_checks import check_schedulable
from pagedcore.engine.scheduling.bucket_align import align_to_bucket
from pagedcore.engine.scheduling.fits import RequestFit
from pagedcore.engine.scheduling.request import Request, RequestStatus
from pagedcore.engine.scheduling.request_blocks import (
    LOOKAHEAD_BLOCKS,
    LOOKAHEAD_MAX_USAGE,
    RequestBlocks,
)
from pagedcore.engine.scheduling.schedule_undo import RequestFault, ScheduleUndo, safe_extreme
from pagedcore.engine.scheduling.scheduler_results import SchedulerResults
from pagedcore.engine.scheduling.scheduler_types import (
    DecodeBatch,
    KVManagerLike,
    ScheduledRequest,
    SchedulerConfig,
    SchedulerOutput,
    SchedulerStats,
)
from pagedcore.kv_cache.spec import KVCacheConfig

__all__ = [
    "LOOKAHEAD_BLOCKS",
    "LOOKAHEAD_MAX_USAGE",
    "DecodeBatch",
    "KVManagerLike",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
]


class Scheduler(SchedulerResults):
    """Decides, step by step, which tokens of which requests run.

    Parameters
    ----------
    config:
        Step limits and policy.
    kv_cache_manager:
        Allocates KV blocks (`pagedcore.kv_cache.KVCacheManager`).
    kv_cache_config:
        The cache layout, used to reject requests that could never fit.
    lookahead_blocks:
        Blocks a decode running past its blocks reserves ahead while the cache is less than
        `LOOKAHEAD_MAX_USAGE` full (0: allocate exactly).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVManagerLike,
        kv_cache_config: KVCacheConfig,
        *,
        lookahead_blocks: int = LOOKAHEAD_BLOCKS,
    ) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.kv_cache_config = kv_cache_config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self.errors: dict[str, str] = {}
        # Block ids and capacity per running request; allocation and the decode fast path.
        self.blocks = RequestBlocks(kv_cache_manager, kv_cache_config,
                                    lookahead_blocks=lookahead_blocks)
        # What the schedule() in progress changed (None outside schedule()).
        self._undo: ScheduleUndo | None = None
        # Requests rejected by a schedule() that then failed: reported by the next one.
        self._carried_rejected: list[Request] = []

    # ---- admission -------------------------------------------------------------------------

    @property
    def fit(self) -> RequestFit:
        """The limits every request must fit (config only; see `RequestFit`)."""
        return RequestFit.of(max_model_len=self.config.max_model_len,
                             max_num_batched_tokens=self.config.max_num_batched_tokens,
                             kv_cache_config=self.kv_cache_config)

    def blocks_needed(self, num_tokens: int) -> int:
        """KV blocks (summed over groups) one request of `num_tokens` tokens holds at most."""
        return self.fit.blocks_needed(num_tokens)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """Raise ValueError when a request of this shape could never be served (``max_tokens``
        None: up to ``max_model_len``)."""
        self.fit.check(num_prompt_tokens, max_tokens)

    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError (and nothing queued) if it could never be served."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        check_schedulable(request)
        self.check_fits(request.num_prompt_tokens, request.params.max_tokens)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling ------------------------------------------------------------------------

    def _num_new_tokens(self, request: Request, num_computed: int, budget: int) -> int:
        num_new = request.num_tokens - num_computed
        threshold = self.config.long_prefill_token_threshold
        if threshold is not None:
            num_new = min(num_new, threshold)
        return min(num_new, budget)

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return safe_extreme(max, self.running)
        return self.running[-1]

    def _peek_waiting(self) -> Request:
        if self.config.policy == "priority":
            return safe_extreme(min, self.waiting)
        return self.waiting[0]

    def block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Block ids of a scheduled request per KV-cache group (a block-table row each)."""
        return self.blocks.ids[request_id]

    def _allocate(
        self,
        request: Request,
        num_new: int,
        *,
        num_cached: int = 0,
        cached_blocks: Any = None,
    ) -> bool:
        return self.blocks.allocate(request, num_new, num_cached=num_cached,
                                    cached_blocks=cached_blocks, undo=self._undo)

    def _free(self, request: Request) -> None:
        self.blocks.free(request)

    def _preempt(self, request: Request) -> None:
        # Blocks this step allocated for it (when it was scheduled earlier in this step, e.g.
        # under the priority policy) are registered in the prefix cache but never written.
        self.kv.uncache_unwritten_blocks(request.request_id, request.num_computed_tokens)
        self.blocks.register_written(request)
        self._free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.metrics.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)

    def _reject(self, request: Request, reason: str) -> None:
        self._free(request)
        request.status = RequestStatus.FINISHED_ABORTED
        self.errors[request.request_id] = reason
        self.requests.pop(request.request_id, None)

    def schedule(self) -> SchedulerOutput:
        """Choose this step's tokens and allocate their KV slots.

        Transactional: when anything inside raises (the KV manager, a broken invariant), the
        step's admissions are undone (requests back in the waiting queue, unchanged), no
        request's ``num_computed_tokens`` moves, the prefix-cache entries of blocks this step
        was about to fill are dropped, and requests rejected so far are reported by the next
        `schedule()`; then the exception propagates. Preemptions already made stand: a
        preempted request is a valid waiting request that loses nothing.

        A failure that belongs to one request (its priority cannot be compared, its prefix
        hashes cannot be computed, e.g. a bad cache salt) fails that request alone: after the
        rollback it is finished with ``FINISHED_ERROR`` (reported in ``rejected``, its error in
        `errors`) and the step is scheduled again without it, so one request can never wedge
        the engine (each retry removes one request: the loop ends).
        """
        while True:
            undo = ScheduleUndo(stats=(self.stats.prompt_tokens, self.stats.prefix_hit_tokens))
            self._undo = undo
            try:
                return self._schedule(undo)
            except RequestFault as fault:
                self._carried_rejected = undo.rollback(
                    running=self.running, waiting=self.waiting, kv=self.kv, stats=self.stats,
                    free=self._free,
                )
                self._fail_alone(fault)
            except BaseException:
                self._carried_rejected = undo.rollback(
                    running=self.running, waiting=self.waiting, kv=self.kv, stats=self.stats,
                    free=self._free,
                )
                raise
            finally:
                self._undo = None

    def _fail_alone(self, fault: RequestFault) -> None:
        """Finish the request a `RequestFault` names with an error (reported next schedule)."""
        request = fault.request
        cause = fault.__cause__
        reason = f"{fault.what} failed: {type(cause).__name__}: {cause}"
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        self.kv.uncache_unwritten_blocks(request.request_id, request.num_computed_tokens)
        self._free(request)
        request.status = RequestStatus.FINISHED_ERROR
        self.errors[request.request_id] = reason
        self.requests.pop(request.request_id, None)
        self._carried_rejected.append(request)

    def _schedule(self, undo: ScheduleUndo) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled = undo.scheduled
        preempted: list[Request] = []
        rejected = undo.rejected
        rejected.extend(self._carried_rejected)
        self._carried_rejected = []

        decodes = self._schedule_decodes(budget)
        if decodes is not None:
            return self._finish_decodes(decodes, budget, scheduled, rejected)

        index = 0
        running = self.running
        # Decode fast path (see `RequestBlocks.allocate`), inlined: this loop runs for every
        # running request.
        fast = self.blocks.fast_path
        while index < len(running) and budget > 0:
            request = running[index]
            start = request.num_computed_tokens
            num_new = request.num_tokens - start
            if num_new == 1 and fast:
                if start < request.block_capacity:
                    scheduled[request.request_id] = ScheduledRequest(request, start, 1,
                                                                     samples=True)
                    budget -= 1
                    index += 1
                    continue
            if num_new > 1:  # a decode (one token) never hits the threshold or the budget
                num_new = self._num_new_tokens(request, start, budget)
            if num_new <= 0:
                index += 1
                continue
            placed = True
            while not self._allocate(request, num_new):
                if len(self.running) == 1:
                    # Alone and still no room: it can never run; do not leave it hanging.
                    self.running.remove(request)
                    self._reject(request, "the KV cache cannot hold this request even alone")
                    rejected.append(request)
                    placed = False
                    break
                victim = self._pick_victim()
                victim_index = self.running.index(victim)
                self.running.pop(victim_index)
                undone = scheduled.pop(victim.request_id, None)
                if undone is not None:
                    budget += undone.num_new_tokens
                if victim_index < index:
                    index -= 1
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    placed = False
                    break
            if not placed:
                continue
            scheduled[request.request_id] = ScheduledRequest(request, start, num_new)
            budget -= num_new
            index += 1

        if not preempted:
            budget = self._schedule_waiting(budget, scheduled, rejected)
        budget += self._align_to_bucket(scheduled, self.config.max_num_batched_tokens - budget)

        stats = (len(self.running), len(self.waiting), float(self.kv.usage))
        output = SchedulerOutput(
            tuple(scheduled.values()), tuple(preempted), tuple(rejected),
            total_tokens=self.config.max_num_batched_tokens - budget,
        )
        for item in output.scheduled:
            item.request.num_computed_tokens = item.start + item.num_new_tokens
        self.stats.num_running, self.stats.num_waiting, self.stats.kv_cache_usage = stats
        return output

    def _schedule_decodes(self, budget: int) -> DecodeBatch | None:
        """The all-decode fast path: every running request takes its one next token.

        Applies when the decode fast path is on (full attention only), every running request
        has exactly one token to compute and the budget holds them all; then the step is what
        the general loop would schedule, built with a few list passes instead of a branchy
        loop per request. Requests that ran past their blocks allocate here (in running
        order, as the general loop would); None when the fast path does not apply or an
        allocation fails (the general loop then redoes the step, preempting as needed: the
        allocations made here stand, and it skips those requests' allocations).
        """
        running = self.running
        n = len(running)
        if not n or n > budget or not self.blocks.fast_path or self._carried_rejected:
            return None
        # One loop reading slots directly (no property call per request: on CPython 3.11 this
        # is ~2.5x faster than `map` passes with attrgetters over the same fields).
        starts: list[int] = []
        append = starts.append
        past: list[Request] = []
        for request in running:
            start = request.num_computed_tokens
            # `num_tokens` (the token in flight included) must be exactly one more.
            if len(request._all_token_ids) + (request.placeholder is not None) != start + 1:
                return None
            append(start)
            if start >= request.block_capacity:
                past.append(request)
        for request in past:  # (in running order)
            if not self._allocate(request, 1):
                return None
        return DecodeBatch(list(running), starts)

    def _finish_decodes(
        self,
        decodes: DecodeBatch,
        budget: int,
        scheduled: dict[str, ScheduledRequest],
        rejected: list[Request],
    ) -> SchedulerOutput:
        """`_schedule`'s tail after the all-decode fast path: admit waiting requests into
        what is left, then advance every scheduled request's ``num_computed_tokens``."""
        budget -= len(decodes)
        items: Sequence[ScheduledRequest] = decodes
        if self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            scheduled.update((d.request.request_id, d) for d in decodes)
            budget = self._schedule_waiting(budget, scheduled, rejected)
            if len(scheduled) > len(decodes):
                budget += self._align_to_bucket(
                    scheduled, self.config.max_num_batched_tokens - budget)
                items = tuple(scheduled.values())
        stats = (len(self.running), len(self.waiting), float(self.kv.usage))
        output = SchedulerOutput(
            items, (), tuple(rejected), total_tokens=self.config.max_num_batched_tokens - budget,
        )
        # Advance every decode's num_computed_tokens.
        for request, start in zip(decodes.requests, decodes.starts, strict=True):
            request.num_computed_tokens = start + 1
        if items is not decodes:
            for item in items[len(decodes):]:
                item.request.num_computed_tokens = item.start + item.num_new_tokens
        self.stats.num_running, self.stats.num_waiting, self.stats.kv_cache_usage = stats
        return output

    def _align_to_bucket(self, scheduled: dict[str, ScheduledRequest], total: int) -> int:
        """Shrink one partial prefill chunk so the step's `total` tokens land on a token bucket
        (``config.token_buckets``); see `pagedcore.engine.scheduling.bucket_align.align_to_bucket`.
        Returns the tokens removed (0: step unchanged)."""
        return align_to_bucket(self.config.token_buckets, scheduled, total, self.kv)

    def _schedule_waiting(
        self, budget: int, scheduled: dict[str, ScheduledRequest], rejected: list[Request]
    ) -> int:
        """Admit waiting requests into the remaining `budget`; returns what is left."""
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self._peek_waiting()
            if request.placeholder is not None:
                break  # preempted with a token in flight: admitted once it landed
            try:
                # Prompt logprobs need the logits of every prompt position (vLLM: no hit).
                computed_blocks, num_cached = self.kv.get_computed_blocks(
                    request, use_cache=not request.needs_prompt_logprobs)
            except Exception as exc:  # this request's own hashes (its cache salt, ...)
                raise RequestFault(request, "looking up its prefix-cache hit") from exc
            if num_cached >= request.num_tokens:
                raise RuntimeError(
                    f"KV manager reported {num_cached} cached tokens for a request of "
                    f"{request.num_tokens}; the last token must always be recomputed"
                )
            num_new = self._num_new_tokens(request, num_cached, budget)
            if not self.config.enable_chunked_prefill and num_new < request.num_tokens - num_cached:
                break
            if not self._allocate(request, num_new, num_cached=num_cached,
                                  cached_blocks=computed_blocks):
                if not self.running:
                    self.waiting.remove(request)
                    self._reject(request, "the KV cache cannot hold this request even alone")
                    rejected.append(request)
                    continue
                break
            assert self._undo is not None
            self._undo.admitted.append((request, request.status, request.num_cached_tokens))
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_cached
                self.stats.prompt_tokens += request.num_prompt_tokens
                self.stats.prefix_hit_tokens += num_cached
            self.running.append(request)
            scheduled[request.request_id] = ScheduledRequest(request, num_cached, num_new)
            budget -= num_new
        return budget
