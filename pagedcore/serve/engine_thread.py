"""The engine thread of `AsyncEngine`: the only code that calls the `LLM`.

`EngineThread` (a base class of `pagedcore.serve.async_engine.AsyncEngine`) runs the loop:
block on the command queue while idle, else drain commands (``add`` / ``abort`` / ``stop``)
and run one `LLM.step`, handing each step's outputs to the requests' event loops in one call
per loop. A failure the step cannot isolate ends the loop: every request then gets
`EngineDeadError`, and so does any request queued afterwards.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import time
from typing import TYPE_CHECKING, Any

from pagedcore.serve.errors import (
    BadRequestError,
    EngineDeadError,
    ServeError,
    ShuttingDownError,
)

if TYPE_CHECKING:
    from pagedcore.engine.llm import LLM

__all__ = ["EngineThread", "RequestStream"]

#: Seconds between two stats snapshots of the engine thread (for /metrics).
_STATS_INTERVAL = 0.05


class RequestStream:
    """The asyncio side of one request: the queue its outputs arrive on."""

    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()

    def put(self, item: Any) -> None:
        """Hand `item` over from the engine thread (safe from any thread)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


def _deliver(batch: list[tuple[RequestStream, Any]]) -> None:
    """On the event loop: put each output on its request's queue."""
    for stream, item in batch:
        stream.queue.put_nowait(item)


class EngineThread:
    """The loop run on the engine thread (a base class of `AsyncEngine`)."""

    # Set by `AsyncEngine.__init__`.
    llm: LLM
    _commands: queue.SimpleQueue[tuple[Any, ...]]
    _streams: dict[str, RequestStream]
    _dead: str | None
    _loop_done: bool
    _stats: dict[str, Any]
    _stats_time: float

    def _run(self) -> None:
        llm = self.llm
        try:
            while True:
                block = not llm.has_unfinished_requests()
                try:
                    command = self._commands.get(block=block)
                except queue.Empty:
                    command = None
                while command is not None:
                    if command[0] == "stop":
                        self._abort_all()
                        self._finish_loop(ShuttingDownError("the server shut down"))
                        return
                    self._handle(command)
                    try:
                        command = self._commands.get_nowait()
                    except queue.Empty:
                        command = None
                if llm.has_unfinished_requests():
                    self._step()
                self._snapshot(force=not llm.has_unfinished_requests())
        except BaseException as exc:
            self._dead = f"{type(exc).__name__}: {exc}"
            error = EngineDeadError(f"the engine stopped after a failure: {self._dead}")
            for stream in self._streams.values():
                stream.put(error)
            self._streams.clear()
            self._finish_loop(error)
            logging.getLogger(__name__).exception("the engine loop stopped")

    def _finish_loop(self, error: ServeError) -> None:
        """Answer the commands still queued (requests nobody will run) as the loop ends."""
        self._loop_done = True  # set before draining: see `generate`
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                command[4].put(error)

    def _handle(self, command: tuple[Any, ...]) -> None:
        llm = self.llm
        if command[0] == "add":
            _, rid, ids, params, stream = command
            try:
                llm.add_request(rid, ids, params)
            except (ValueError, TypeError) as exc:
                stream.put(BadRequestError(str(exc), param="prompt"))
                return
            self._streams[rid] = stream
        elif command[0] == "abort":
            rid = command[1]
            if self._streams.pop(rid, None) is not None:
                try:
                    llm.abort(rid)
                except KeyError:  # it finished in the meantime
                    pass

    def _step(self) -> None:
        from pagedcore.engine.errors import EngineStepError

        try:
            outputs = self.llm.step()
        except EngineStepError as exc:
            outputs = exc.outputs
        # One hand-over per event loop per step (not one per request): each costs a wake-up
        # of the loop, and a step may advance hundreds of requests.
        batches: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            batches.setdefault(stream.loop, []).append((stream, out))
            if out.finished:
                del self._streams[out.request_id]
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                pass

    def _abort_all(self) -> None:
        for rid, stream in list(self._streams.items()):
            try:
                stream.put(self.llm.abort(rid))
            except KeyError:
                pass
        self._streams.clear()
        self._snapshot(force=True)

    def _snapshot(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._stats_time >= _STATS_INTERVAL:
            self._stats_time = now
            stats = self.llm.stats()
            stats.pop("cudagraph", None)
            self._stats = stats
