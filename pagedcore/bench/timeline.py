"""An arrival-timeline driver over the engine's online API (`LLM.add_request` / `LLM.step`).

Requests join the engine when their arrival time has passed, checked between steps (a step is
never interrupted, as in a real server loop). Latencies are measured from the *scheduled*
arrival time, not from when the driver got round to adding the request, so a request that
arrives during a long step is charged for the wait. Token times are the end of the step that
produced the token.

The clock is pluggable: `WallClock` measures real time; `VirtualClock` charges each step a
modelled cost (``fixed + per_token * tokens computed``), which makes the timeline arithmetic
deterministic for tests and lets one reason about a schedule without noise.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs

__all__ = ["Arrival", "StepRecord", "Trace", "VirtualClock", "WallClock", "run_timeline"]


@attrs.define(kw_only=True)
class Arrival:
    """One request of a workload: it arrives `at` seconds after the start."""

    request_id: str
    at: float
    prompt: list[int]
    params: Any  # SamplingParams (kept untyped so this module imports nothing heavy)


@attrs.define(kw_only=True)
class Trace:
    """What happened to one request (times in seconds since the start of the timeline)."""

    request_id: str
    arrival: float
    num_prompt_tokens: int
    token_times: list[float] = attrs.field(factory=list)
    num_cached_tokens: int | None = None
    finished: float | None = None
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        """Arrival to first token, or None when no token was produced."""
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive tokens (inter-token latencies)."""
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def latency(self) -> float | None:
        """Arrival to completion, or None when unfinished."""
        return None if self.finished is None else self.finished - self.arrival


@attrs.define(kw_only=True, frozen=True)
class StepRecord:
    """One engine step: when it started and ended, and how many tokens it computed."""

    start: float
    end: float
    num_tokens: int
    num_running: int


class Clock(Protocol):
    """Where the driver reads time and how it waits for the next arrival."""

    def now(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...

    def charge_step(self, num_tokens: int) -> None: ...


class WallClock:
    """Real time (`time.perf_counter`), with a device sync before each reading."""

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self._sync = sync

    def now(self) -> float:
        if self._sync is not None:
            self._sync()
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds))

    def charge_step(self, num_tokens: int) -> None:
        """Real steps take their own time."""


class VirtualClock:
    """Modelled time: each step costs ``fixed + per_token * num_tokens`` seconds."""

    def __init__(self, *, fixed: float = 0.0, per_token: float = 1.0) -> None:
        self.fixed = fixed
        self.per_token = per_token
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += max(0.0, seconds)

    def charge_step(self, num_tokens: int) -> None:
        self.t += self.fixed + self.per_token * num_tokens


def run_timeline(
    llm: Any,
    arrivals: Sequence[Arrival],
    *,
    clock: Clock | None = None,
    outputs: dict[str, list[int]] | None = None,
) -> tuple[list[Trace], list[StepRecord]]:
    """Drive `llm` through `arrivals` until every request has finished.

    Parameters
    ----------
    llm:
        A `pagedcore.LLM` with no unfinished requests.
    arrivals:
        The workload; arrival times need not be sorted.
    clock:
        `WallClock()` by default.
    outputs:
        When given, filled with each finished request's generated token ids (sample 0).

    Returns
    -------
    traces, steps:
        One `Trace` per arrival (in the order given) and one `StepRecord` per engine step.
    """
    if llm.has_unfinished_requests():
        raise ValueError("run_timeline needs an idle engine; finish or abort its requests first")
    ids = [a.request_id for a in arrivals]
    if len(set(ids)) != len(ids):
        raise ValueError("arrival request ids must be unique")
    clock = clock if clock is not None else WallClock()
    pending = sorted(arrivals, key=lambda a: a.at)
    traces = {a.request_id: Trace(request_id=a.request_id, arrival=a.at,
                                  num_prompt_tokens=len(a.prompt)) for a in arrivals}
    seen: dict[str, int] = {}
    steps: list[StepRecord] = []
    start = clock.now()
    index = 0
    while index < len(pending) or llm.has_unfinished_requests():
        t = clock.now() - start
        while index < len(pending) and pending[index].at <= t:
            a = pending[index]
            llm.add_request(a.request_id, a.prompt, a.params)
            seen[a.request_id] = 0
            index += 1
        if not llm.has_unfinished_requests():
            clock.sleep(pending[index].at - t)
            continue
        changed = llm.step()
        # The engine's own count: prefix hits and preemption recomputes as it ran them.
        computed = int(llm.last_step_num_scheduled_tokens)
        clock.charge_step(computed)
        end = clock.now() - start
        steps.append(StepRecord(start=t, end=end, num_tokens=computed,
                                num_running=len(llm.scheduler.running)))
        for out in changed:
            _record(traces[out.request_id], out, end, seen, outputs)
    return [traces[i] for i in ids], steps


def _record(trace: Trace, out: Any, end: float, seen: dict[str, int],
            outputs: dict[str, list[int]] | None) -> None:
    """Fold one step's `RequestOutput` into the request's trace."""
    produced = len(out.outputs[0].token_ids)
    trace.token_times += [end] * (produced - seen[out.request_id])
    seen[out.request_id] = produced
    if out.finished:
        trace.finished = end
        trace.num_cached_tokens = out.num_cached_tokens
        trace.error = out.error
        if outputs is not None:
            outputs[out.request_id] = list(out.outputs[0].token_ids)
