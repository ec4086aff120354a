"""The engine thread of `AsyncEngine` (its default, in-process mode): `CoreLoop` on a thread.

Commands arrive on a `queue.SimpleQueue`; each step's items reach their requests' event loops
in one ``call_soon_threadsafe`` per loop (one wake-up of the loop, not one per request). The
thread shares the interpreter (and its GIL) with the event loop, which is simple and lets
tests reach into the `LLM`; `pagedcore.serve.engine_process` runs the same loop in a process
of its own, which is what `pagedcore serve` does by default.
"""

from __future__ import annotations

import asyncio
import logging
import queue
from typing import TYPE_CHECKING, Any

from pagedcore.serve.core_loop import Command, CoreLoop, Item
from pagedcore.serve.deltas import CoreError
from pagedcore.serve.step_trace import StepTrace

if TYPE_CHECKING:
    from pagedcore.engine.llm import LLM

__all__ = ["EngineThread", "RequestStream"]


class RequestStream:
    """The asyncio side of one request: the items that arrived for it and not taken yet.

    Not an `asyncio.Queue`: the consumer takes everything waiting at once (`take`), and with
    hundreds of streams a queue's per-item put / get / wake-up cost shows in the event loop;
    here an item is one list append, and a wake-up one future per batch.
    """

    __slots__ = ("items", "loop", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: list[Item] = []
        self.waiter: asyncio.Future[None] | None = None

    def push(self, item: Item) -> None:
        """Hand `item` over (on the event loop)."""
        self.items.append(item)
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def put(self, item: Item) -> None:
        """Hand `item` over from another thread."""
        try:
            self.loop.call_soon_threadsafe(self.push, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    async def take(self) -> list[Item]:
        """Every item waiting, in arrival order (waits for at least one)."""
        while not self.items:
            waiter = self.waiter = self.loop.create_future()
            try:
                await waiter
            finally:
                if self.waiter is waiter:
                    self.waiter = None
        items, self.items = self.items, []
        return items


def _deliver(batch: list[tuple[RequestStream, Item]]) -> None:
    """On the event loop: put each item on its request's queue."""
    for stream, item in batch:
        stream.push(item)


class EngineThread:
    """The in-process engine loop (a base class of `AsyncEngine`)."""

    # Set by `AsyncEngine.__init__`.
    llm: LLM | None
    _commands: queue.SimpleQueue[Command]
    _streams: dict[str, RequestStream]
    _dead: str | None
    _loop_done: bool
    _stats: dict[str, Any]
    stream_interval: int

    def _run(self) -> None:
        assert self.llm is not None
        commands = self._commands

        def recv(block: bool) -> Command | None:
            try:
                return commands.get(block=block)
            except queue.Empty:
                return None

        try:
            CoreLoop(self.llm, self._emit_threaded, stream_interval=self.stream_interval,
                     trace=StepTrace.from_env(proc="server")).run(recv)
        except BaseException as exc:
            self._dead = f"{type(exc).__name__}: {exc}"
            self._end(CoreError("dead", f"the engine stopped after a failure: {self._dead}"))
            logging.getLogger(__name__).exception("the engine loop stopped")
        else:
            self._end(CoreError("shutdown", "the server shut down"))

    def _emit_threaded(self, items: list[tuple[str, Item]],
                       stats: dict[str, Any] | None) -> None:
        if stats is not None:
            self._stats = stats
        batches: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Item]]] = {}
        streams = self._streams
        for rid, item in items:
            stream = streams.get(rid)
            if stream is not None:
                batches.setdefault(stream.loop, []).append((stream, item))
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                pass

    def _end(self, error: CoreError) -> None:
        """The loop ended: answer every request still waiting with `error`."""
        self._loop_done = True  # set before answering: see `AsyncEngine.generate`
        for stream in list(self._streams.values()):
            stream.put(error)
