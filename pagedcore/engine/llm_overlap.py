"""Overlap scheduling, the engine's half: the step loop of `LLM(async_scheduling=True)`.

`OverlapStep` is a base class of `pagedcore.engine.llm.LLM`. One `step()` call:

1. schedules step N+1 while step N still runs on the device (its sampled requests carry a
   placeholder token, ``Request.placeholder``, which the scheduler counts like a token);
2. prepares step N+1's inputs (placeholders written as negative ids), replaces them on the
   device with step N's sampled ids, launches the forward and the sampler, and queues the
   sampled ids' copy to pinned host memory behind them (no host sync anywhere);
3. only then waits for step N's copy (not for step N+1) and runs step N's host half one step
   behind: tokens appended, stop checks, finished requests freed, outputs built.

A request that step N finishes (EOS, a stop token) was already scheduled into step N+1: that
one speculative token is discarded, never appended or emitted, and the request's blocks are
freed at once (step N+1's writes into them precede, on the device's stream, any later step
that reuses them). A request whose step-N token ends it by length (``max_tokens``,
``max_model_len``) is known to finish and gets no placeholder, so no token is spent on it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import attrs

from pagedcore.engine.errors import EngineStepError
from pagedcore.engine.runner.overlap import (
    InputFence,
    placeholder_for_row,
    resolve_placeholders,
)
from pagedcore.engine.sampling.prompt_logprobs import record_prompt_logprobs
from pagedcore.engine.scheduling.request import FINISHED_VALUES, Request
from pagedcore.engine.scheduling.scheduler_types import DecodeBatch, SchedulerOutput

if TYPE_CHECKING:
    from pagedcore.engine.distributed.executor import TensorParallelExecutor
    from pagedcore.engine.output_builder import ParentRequest
    from pagedcore.engine.outputs import RequestOutput
    from pagedcore.engine.runner.model_runner import ModelRunner
    from pagedcore.engine.sampling.device_sample import SampledTokens
    from pagedcore.engine.sampling.sampler import Sampler
    from pagedcore.engine.scheduling.scheduler import Scheduler

__all__ = ["InflightStep", "OverlapStep"]


class InflightStep:
    """A launched step whose host half has not run: its plan, sampled rows and tokens."""

    __slots__ = ("requests", "sampled", "scheduled")

    def __init__(
        self, scheduled: SchedulerOutput, requests: list[Request], sampled: SampledTokens
    ) -> None:
        self.scheduled = scheduled
        #: The request of each sampled row, in row order.
        self.requests = requests
        self.sampled = sampled


def decode_token_ids(batch: DecodeBatch) -> list[int]:
    """Each request's input id of an all-decode step: its last token, or its placeholder
    when that token is still on the device."""
    reqs = batch.requests
    marks = [r.placeholder for r in reqs]
    if None not in marks:  # the steady state: every token is in flight
        return marks  # type: ignore[return-value]  # (no None)
    out: list[int] = []
    for request, start, mark in zip(reqs, batch.starts, marks, strict=True):
        out.append(request.all_token_ids[start] if mark is None else mark)
    return out


def _clear_placeholders(step: InflightStep | None) -> None:
    if step is not None:
        for request in step.requests:
            request.placeholder = None


class OverlapStep:
    """`LLM.step` with overlap scheduling (a base class of `LLM`)."""

    # Set by `LLM.__init__`.
    scheduler: Scheduler
    runner: ModelRunner | TensorParallelExecutor
    sampler: Sampler
    phase_time: dict[str, float]
    host_time: float
    step_time: float
    num_steps: int
    last_step_num_scheduled_tokens: int
    _parents: dict[str, ParentRequest]
    _inflight: InflightStep | None
    _fence: InputFence
    _tensor_parallel: bool

    if TYPE_CHECKING:

        def _fail_step(self, scheduled: SchedulerOutput, exc: BaseException) -> Any: ...

        def _fail_rows(self, row_errors: dict[str, str], *, now: float) -> list[Request]: ...

        def _collect_outputs(
            self, changed: list[Request], *, finished_only: bool
        ) -> list[RequestOutput]: ...

        def _end_step(
            self, changed: list[Request], *, finished_only: bool, t0: float, t_update: float
        ) -> list[RequestOutput]: ...

    def _step_overlap(self, *, finished_only: bool) -> list[RequestOutput]:
        """One overlapped step: launch step N+1, then finish step N (see the module doc)."""
        t0 = time.perf_counter()
        phases = self.phase_time
        scheduled = self.scheduler.schedule()
        self.last_step_num_scheduled_tokens = int(scheduled.num_scheduled_tokens)
        phases["schedule"] += time.perf_counter() - t0
        launch_error: BaseException | None = None
        launched: InflightStep | None = None
        try:
            launched = self._launch(scheduled, t0)
        except BaseException as exc:
            launch_error = exc
        previous, self._inflight = self._inflight, launched
        t_update = time.perf_counter()
        changed: list[Request] = list(scheduled.rejected)
        if previous is not None:
            try:
                changed += self._finish_inflight(previous, now=t_update)
            except BaseException as exc:
                if launch_error is not None:  # both halves failed: fail the launched one too
                    self.scheduler.fail_step(scheduled, f"{type(exc).__name__}: {exc}",
                                             now=t_update)
                self._fail_step(previous.scheduled, exc)
        if launch_error is not None:
            done = self._collect_outputs(changed, finished_only=True)
            try:
                self._fail_step(scheduled, launch_error)
            except EngineStepError as err:
                # Requests the previous step finished are reported with the failure.
                err.outputs[:0] = done
                raise
        return self._end_step(changed, finished_only=finished_only, t0=t0, t_update=t_update)

    def _launch(self, scheduled: SchedulerOutput, t0: float) -> InflightStep | None:
        """Prepare and launch a scheduled step; nothing waits for the device."""
        phases = self.phase_time
        previous = self._inflight
        if scheduled.is_empty:
            _clear_placeholders(previous)
            self.host_time += time.perf_counter() - t0
            return None
        t_prepare = time.perf_counter()
        try:
            step = scheduled.scheduled
            blocks = self.scheduler.blocks
            changed = blocks.take_changed()
            if isinstance(step, DecodeBatch):
                step.changed = changed
                step.token_ids = decode_token_ids(step)
            # Step N's uploads must have left the pinned buffers before they are rewritten.
            self._fence.wait()
            if self._tensor_parallel:
                # The workers get step N's sampled ids over the compute group.
                executor: Any = self.runner
                inputs = executor.prepare(
                    step, blocks.ids.__getitem__,
                    sampled=None if previous is None else previous.sampled.tokens)
            else:
                inputs = self.runner.prepare(step, blocks.ids.__getitem__)
            if previous is not None:
                resolve_placeholders(inputs.input_ids, previous.sampled.tokens)
        finally:
            # Consumed (or never to be: a request preempted with its token in flight waits
            # for that token, not for a placeholder); this step's rows get their own below.
            _clear_placeholders(previous)
        self._fence.record(inputs.input_ids.device)
        t_execute = time.perf_counter()
        self.host_time += t_execute - t0
        phases["prepare"] += t_execute - t_prepare
        logits = self.runner.execute(inputs)
        if inputs.prompt_rows is not None:
            # (`LLM.step` runs such steps without overlap; this one waits for its logits.)
            num_sampled = int(inputs.logits_indices.shape[0])
            record_prompt_logprobs(inputs.prompt_rows, logits[num_sampled:])
            logits = logits[:num_sampled]
        rows = inputs.sample_rows
        requests: list[Request] = list(
            rows.requests if isinstance(rows, DecodeBatch) else [r.request for r in rows]
        )
        ids = [r.request_id for r in requests]
        sampled = self.sampler.sample_device(logits, [r.params for r in requests], ids,
                                             sequences=requests)
        sampled.start_copy()
        max_len = self.scheduler.config.max_model_len
        errors = sampled.row_errors
        for row, request in enumerate(requests):
            # The sampled token's index is num_computed_tokens (after this step's schedule).
            total = request.num_computed_tokens + 1
            if (total - request._num_prompt_tokens >= (request.params.max_tokens or max_len)
                    or total >= max_len or (errors and request.request_id in errors)):
                continue  # it ends with this token: nothing is scheduled after it
            request.placeholder = placeholder_for_row(row)
        phases["execute"] += time.perf_counter() - t_execute
        # Its rejected requests are reported by this step() call, not again when it finishes.
        if scheduled.rejected:
            scheduled = attrs.evolve(scheduled, rejected=())
        return InflightStep(scheduled, requests, sampled)

    def _finish_inflight(self, step: InflightStep, *, now: float) -> list[Request]:
        """Step N's host half: wait for its tokens, append them, stop and free requests."""
        t_wait = time.perf_counter()
        tokens, logprobs = step.sampled.to_host()
        self.phase_time["wait"] = self.phase_time.get("wait", 0.0) + time.perf_counter() - t_wait
        errors = step.sampled.row_errors
        requests = step.requests
        # (Loops reading slots directly: at 256 requests a property call per request is a
        # visible share of the step's host time.)
        finished_values = FINISHED_VALUES
        sampled: dict[str, tuple[int, dict[int, float] | None]] = {}
        for request, token, lp in zip(requests, tokens, logprobs, strict=True):
            if request.status._value_ in finished_values or (
                    errors and request.request_id in errors):
                continue  # aborted or failed since: its token is dropped
            sampled[request.request_id] = (token, lp)
        # A request already scheduled into the step in flight with this token as its input
        # is counted back if it finishes now (`count_back`).
        changed = self.scheduler.update_from_output(step.scheduled, sampled, now=now,
                                                    count_back=True)
        if errors:
            changed += self._fail_rows(errors, now=now)
        forget = self.sampler.forget
        for request in changed:
            if request.status._value_ in finished_values:
                forget(request.request_id)
        return changed

    def drain(self) -> list[RequestOutput]:
        """Finish the step in flight, if any (outputs of the requests it changed)."""
        step, self._inflight = self._inflight, None
        if step is None:
            return []
        _clear_placeholders(step)
        changed = self._finish_inflight(step, now=time.perf_counter())
        return self._collect_outputs(changed, finished_only=False)
