"""Failure isolation of `LLM`: what a failed step, request or output build finishes.

`FailureIsolation` is a base class of `pagedcore.engine.llm.LLM`. A step that fails as a
whole (the model runner, a backend) finishes its requests with ``finish_reason == "error"``;
a failure that belongs to one request (its sampler setup, building its output) finishes that
request alone, blocks freed, and its neighbours run on unchanged. Nothing is left orphaned:
a request the scheduler no longer holds is finished by `_reap_orphans`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from pagedcore.engine.errors import EngineStepError, step_failure_message
from pagedcore.engine.output_builder import ParentRequest, build_output, plain_outputs
from pagedcore.engine.outputs import RequestOutput
from pagedcore.engine.scheduling.request import Request, RequestStatus

if TYPE_CHECKING:
    from pagedcore.engine.sampling.sampler import Sampler
    from pagedcore.engine.scheduling.scheduler import Scheduler, SchedulerOutput

__all__ = ["FailureIsolation"]


class FailureIsolation:
    """Finishing failed steps and requests for `LLM` (a base class of it)."""

    # Set by `LLM.__init__`.
    scheduler: Scheduler
    sampler: Sampler
    tokenizer: Any
    num_steps: int
    _parents: dict[str, ParentRequest]
    _child_parent: dict[str, ParentRequest]

    def _fail_step(self, scheduled: SchedulerOutput, exc: BaseException) -> NoReturn:
        """Finish the requests of a step that raised `exc` with an error, then raise."""
        from pagedcore.engine.distributed.group import TensorParallelError

        now = time.perf_counter()
        reason = f"{type(exc).__name__}: {exc}"
        self.num_steps += 1
        failed = self.scheduler.fail_step(scheduled, reason, now=now)
        if isinstance(exc, TensorParallelError):
            # A rank failed and the engine is stopped: nothing queued can ever run.
            failed += [c for p in self._parents.values() for c in p.children]
        parents = self._parents_of(failed)
        # Sibling samples of a failed request fail with it (the request is one unit).
        self.scheduler.fail([c for p in parents.values() for c in p.children], reason, now=now)
        parents.update(self._parents_of(scheduled.rejected))
        for parent in parents.values():
            for child in parent.children:
                self.sampler.forget(child.request_id)
        outputs = [self._output(p) for p in parents.values()]
        if isinstance(exc, TensorParallelError):
            exc.outputs = outputs  # nothing the requests produced is lost with the engine
            raise exc
        if not isinstance(exc, Exception):
            raise exc
        ids = [r.request_id for r in failed]
        raise EngineStepError(
            step_failure_message(exc, self.num_steps - 1, ids), outputs=outputs
        ) from exc

    def _parents_of(self, requests: Iterable[Request]) -> dict[str, ParentRequest]:
        """The user requests (by id, in first-seen order) that `requests` are samples of."""
        child_parent = self._child_parent
        out: dict[str, ParentRequest] = {}
        for request in requests:
            parent = child_parent[request.request_id]
            out[parent.request_id] = parent
        return out

    def _fail_parents(
        self, parents: Iterable[ParentRequest], reason: str, *, finished_too: bool = False
    ) -> list[Request]:
        """Finish the unfinished samples of `parents` with an error (blocks freed), and with
        `finished_too` the finished ones as well (their output is lost); the failed ones."""
        now = time.perf_counter()
        failed: list[Request] = []
        errors = self.scheduler.errors
        for parent in parents:
            children = parent.children
            in_scheduler = [c for c in children if c.request_id in self.scheduler.requests]
            self.scheduler.fail(in_scheduler, reason, now=now)
            for child in children:
                if child.status is RequestStatus.FINISHED_ERROR:
                    pass
                elif finished_too or not child.status.finished:
                    child.status = RequestStatus.FINISHED_ERROR
                else:
                    continue
                errors.setdefault(child.request_id, reason)
                self.sampler.forget(child.request_id)
                failed.append(child)
        return failed

    def _fail_rows(self, row_errors: dict[str, str], *, now: float) -> list[Request]:
        """Fail the requests (with their sibling samples) whose sampling setup raised."""
        parents = [self._child_parent[i] for i in row_errors if i in self._child_parent]
        failed: list[Request] = []
        for parent in {p.request_id: p for p in parents}.values():
            reason = next(row_errors[c.request_id] for c in parent.children
                          if c.request_id in row_errors)
            failed += self._fail_parents([parent], reason)
        return failed

    def _reap_orphans(self) -> None:
        """Finish (with an error) and drop requests the scheduler no longer holds."""
        orphans = [p for p in self._parents.values()
                   if not any(c.request_id in self.scheduler.requests for c in p.children)]
        for parent in orphans:
            if not all(c.status.finished for c in parent.children):
                self._fail_parents([parent], "internal error: the request was lost")
            self._output(parent)
            self._parents.pop(parent.request_id, None)

    def _outputs(self, parents: Sequence[ParentRequest]) -> list[RequestOutput]:
        """`_output` of each of `parents`, in order (without a tokenizer the plain ones are
        built in one loop, `plain_outputs`)."""
        if self.tokenizer is not None or not parents:
            return [self._output(p) for p in parents]
        try:
            outputs, others, finished = plain_outputs(parents, errors=self.scheduler.errors)
        except Exception:  # (reads attributes only; `_output` isolates a failure)
            return [self._output(p) for p in parents]
        for i in others:
            outputs[i] = self._output(parents[i])
        pop_parent, pop_child = self._parents.pop, self._child_parent.pop
        for parent in finished:
            pop_parent(parent.request_id, None)
            pop_child(parent.children[0].request_id, None)
        return outputs  # type: ignore[return-value]  # (no None left)

    def _output(self, parent: ParentRequest) -> RequestOutput:
        """`parent`'s output now; a finished parent leaves the engine's bookkeeping.

        When building it raises (the tokenizer's ``decode``, say), that request alone is
        finished with an error and its output carries its tokens without text.
        """
        try:
            out = build_output(parent, tokenizer=self.tokenizer, errors=self.scheduler.errors,
                               delta=parent.delta)
        except Exception as exc:
            reason = f"building the output failed: {type(exc).__name__}: {exc}"
            self._fail_parents([parent], reason, finished_too=True)
            out = build_output(parent, tokenizer=None, errors=self.scheduler.errors,
                               delta=parent.delta)
        if out.finished:
            self._parents.pop(parent.request_id, None)
            for child in parent.children:
                self._child_parent.pop(child.request_id, None)
        return out
