"""`CoreLoop`: the loop that owns the `LLM`, whether it runs on a thread or in its own process.

It blocks on its command source while idle, else drains the commands waiting (``add`` /
``abort`` / ``stop``) and runs one `LLM.step`; after each it emits one list of
``(request_id, raw delta | CoreError)`` for the step (and a stats snapshot every
`STATS_INTERVAL` seconds); a raw delta is a plain tuple of `StreamDelta`'s fields, which the
consumer turns into one (`StreamDelta._make`): a step's hundreds of them pickle several times
faster than objects. Requests are added with delta outputs, so what a step emits is only what
it produced: cheap to build, to pickle and to hand over. An exception out of `run` means
the loop is dead; its owner fails every request.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from pagedcore.engine.output_builder import DELTA_FIELDS
from pagedcore.engine.scheduling.fits import RequestFit
from pagedcore.serve.deltas import CoreError, StreamDelta

if TYPE_CHECKING:
    from pagedcore.engine.llm import LLM
    from pagedcore.engine.outputs import RequestOutput
    from pagedcore.serve.step_trace import StepTrace

__all__ = ["STATS_INTERVAL", "Command", "CoreLoop", "Emit", "EngineInfo", "Item"]

#: Where a raw delta (`StreamDelta`'s fields, in order) holds ``num_generated_tokens``.
_NUM_GENERATED = StreamDelta._fields.index("num_generated_tokens")
_FINISH = StreamDelta._fields.index("finish_reason")
assert StreamDelta._fields == DELTA_FIELDS, "the engine's raw deltas are StreamDelta's fields"

#: Seconds between two stats snapshots of the loop (for /metrics).
STATS_INTERVAL = 0.05

#: ``("add", request_id, prompt_token_ids, params)``, ``("abort", request_id)``, ``("stop",)``.
Command = tuple[Any, ...]
#: A raw delta (`StreamDelta`'s fields, in order) or the error that ended the sequence.
Item = tuple[Any, ...] | CoreError
#: Receives a step's items and, when one was taken, a stats snapshot (`LLM.stats` keys).
Emit = Callable[[list[tuple[str, Item]], "dict[str, Any] | None"], None]


@attrs.frozen(kw_only=True)
class EngineInfo:
    """What the front end knows of the engine (picklable: sent by an engine process)."""

    model_name: str
    tokenizer: Any
    max_model_len: int
    max_num_seqs: int
    vocab_size: int
    fit: RequestFit
    backend_names: tuple[str, ...]
    device: str
    #: Objects of the engine's startup heap moved out of the collector's reach
    #: (`pagedcore.serve.gc_control.freeze_startup_heap`; 0: not frozen).
    frozen_objects: int = 0

    @classmethod
    def of(cls, llm: LLM) -> EngineInfo:
        """The facts of `llm`."""
        return cls(model_name=str(llm.model_name), tokenizer=llm.tokenizer,
                   max_model_len=int(llm.max_model_len),
                   max_num_seqs=int(llm.scheduler_config.max_num_seqs),
                   vocab_size=int(llm.model.config.vocab_size), fit=llm.scheduler.fit,
                   backend_names=tuple(sorted(set(llm.backend_names))),
                   device=str(llm.device))


class CoreLoop:
    """Runs the engine for a front end; see the module docstring.

    Parameters
    ----------
    llm:
        The engine (nothing else calls it while the loop runs).
    emit:
        Called once per step with its items (and after commands that produced some).
    stream_interval:
        Hand out the running requests' new tokens every this many steps (finished requests
        every step). The outputs of hundreds of running requests cost the engine host time
        every step; with an interval of k each stream gets up to k tokens per delta, and the
        engine builds its outputs once per k steps (SGLang's ``--stream-interval``).
    """

    def __init__(self, llm: LLM, emit: Emit, *, stream_interval: int = 1,
                 trace: StepTrace | None = None) -> None:
        if not isinstance(stream_interval, int) or stream_interval < 1:
            raise ValueError(f"stream_interval must be an integer >= 1, got {stream_interval!r}")
        self.llm = llm
        self.emit = emit
        self.stream_interval = stream_interval
        #: The loop's timeline (`pagedcore.serve.step_trace`), when one is kept.
        self.trace = trace
        self._generated: dict[str, int] = {}  # live request id -> tokens generated so far
        self._stats_time = 0.0
        self._steps = 0

    def run(self, recv: Callable[[bool], Command | None]) -> None:
        """Serve commands until ``stop`` (then abort every request and return).

        ``recv(block)`` returns the next command, or None when `block` is False and none is
        waiting.
        """
        if self.trace is not None:
            from pagedcore.serve.gc_control import watch_gc

            unwatch = watch_gc(self.trace.row, self.trace.proc)
            try:
                self._run_traced(recv, self.trace)
            finally:
                unwatch()
                self.trace.close()
            return
        llm = self.llm
        while True:
            command = recv(not llm.has_unfinished_requests())
            items: list[tuple[str, Item]] = []
            while command is not None:
                if command[0] == "stop":
                    self.emit(self._abort_all(), self._snapshot(force=True))
                    return
                self._handle(command, items)
                command = recv(False)
            if llm.has_unfinished_requests():
                items += self._step()
            stats = self._snapshot(force=not llm.has_unfinished_requests())
            if items or stats is not None:
                self.emit(items, stats)

    def _run_traced(self, recv: Callable[[bool], Command | None], trace: StepTrace) -> None:
        """`run` with each wait, command batch and step written to `trace`."""
        llm, clock = self.llm, time.perf_counter
        while True:
            block = not llm.has_unfinished_requests()
            if block:
                trace.flush()
            t = clock()
            command = recv(block)
            if block:
                trace.wait(t, clock() - t)
            items: list[tuple[str, Item]] = []
            t, adds, others = clock(), 0, 0
            while command is not None:
                if command[0] == "stop":
                    self.emit(self._abort_all(), self._snapshot(force=True))
                    return
                self._handle(command, items)
                adds += command[0] == "add"
                others += command[0] != "add"
                command = recv(False)
            if adds or others:
                trace.commands(t, adds, others)
            t = t_step = clock()
            stepped = llm.has_unfinished_requests()
            if stepped:
                items += self._step()
                t_step = clock()
            stats = self._snapshot(force=not llm.has_unfinished_requests())
            if items or stats is not None:
                self.emit(items, stats)
            if stepped:
                scheduler = llm.scheduler
                trace.step(t, t_step - t, clock() - t_step, items=len(items),
                           running=len(scheduler.running), waiting=len(scheduler.waiting),
                           tokens=int(llm.last_step_num_scheduled_tokens))

    def _handle(self, command: Command, items: list[tuple[str, Item]]) -> None:
        if command[0] == "add":
            _, rid, ids, params = command
            try:
                self.llm.add_request(rid, ids, params, delta=True)
            except (ValueError, TypeError) as exc:
                items.append((rid, CoreError("bad_request", str(exc), "prompt")))
                return
            self._generated[rid] = 0
        elif command[0] == "abort":
            rid = command[1]
            if self._generated.pop(rid, None) is not None:
                try:
                    self.llm.abort(rid)
                except KeyError:  # it finished in the meantime
                    pass

    def _step(self) -> list[tuple[str, Item]]:
        from pagedcore.engine.errors import EngineStepError

        self._steps += 1
        # Outputs are deltas: a step that builds none leaves its tokens to the next that does.
        finished_only = self._steps % self.stream_interval != 0
        # Most outputs come as raw deltas already (one-sample requests without logprobs);
        # `step` returns the others as `RequestOutput`s.
        raw: list[tuple[Any, ...]] = []
        try:
            outputs = self.llm.step(finished_only=finished_only, deltas=raw)
        except EngineStepError as exc:
            outputs = exc.outputs
        items: list[tuple[str, Item]] = []
        generated = self._generated
        for delta in raw:
            rid = delta[0]
            if rid not in generated:
                continue
            if delta[_FINISH] is None:
                generated[rid] = delta[_NUM_GENERATED]
            else:
                del generated[rid]
            items.append((rid, delta))
        for out in outputs:
            rid = out.request_id
            seen = generated.get(rid)
            if seen is None:
                continue
            item = _item(out, seen)
            if out.finished:
                del generated[rid]
            elif not isinstance(item, CoreError):
                generated[rid] = item[_NUM_GENERATED]
            items.append((rid, item))
        return items

    def _abort_all(self) -> list[tuple[str, Item]]:
        items: list[tuple[str, Item]] = []
        for rid, seen in self._generated.items():
            try:
                items.append((rid, _item(self.llm.abort(rid), seen)))
            except KeyError:
                pass
        self._generated.clear()
        return items

    def _snapshot(self, *, force: bool = False) -> dict[str, Any] | None:
        now = time.monotonic()
        if not force and now - self._stats_time < STATS_INTERVAL:
            return None
        self._stats_time = now
        stats = self.llm.stats()
        stats.pop("cudagraph", None)
        return stats


def _item(out: RequestOutput, seen: int) -> Item:
    """A delta output of one sequence as a raw `StreamDelta` (or the error that ended it)."""
    completion = out.outputs[0]
    if completion.finish_reason == "error":
        return CoreError("failed", f"the engine failed while computing request "
                                   f"{out.request_id!r}: {out.error or 'unknown error'}")
    return (out.request_id, completion.text, completion.token_ids, completion.logprobs,
            completion.finish_reason, completion.stop_reason, len(out.prompt_token_ids),
            out.num_cached_tokens, seen + len(completion.token_ids), out.prompt_logprobs)
