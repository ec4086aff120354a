"""The engine in a process of its own: `EngineProcess` (the front end's side) and
`run_engine_core` (the process's body), which runs `CoreLoop` there.

Why a process: on a thread, the engine shares the GIL with the event loop that turns every
token of every stream into a server-sent event, and each waits for the other; a step with
hundreds of streams took ~3x longer than in `LLM.generate` (see docs/serving.md). In its own
process the engine steps at `LLM.generate`'s pace; the front end's event loop only unpickles
one message per step and feeds the streams, and a stream that falls behind gets the tokens
waiting for it merged into one chunk.

Wire format: two pipes, each carrying pickled frames (an 8-byte length, then the pickle).
Commands go to the process (``("add", ...)``, ``("abort", id)``, ``("stop",)``); each step's
items come back as one frame. The front end never blocks on either pipe: it reads on its
event loop (``loop.add_reader``: everything available in one call, dispatched at once) and
writes without blocking (what the pipe does not take waits in a buffer, flushed by
``loop.add_writer``), so the engine blocking on a full output pipe can never deadlock with
the front end blocking on a full command pipe. Messages from the process:
``("ready", EngineInfo)``, ``("failed", message, is_user_error)`` (the engine could not be
built), ``("step", items, stats)``, ``("dead", reason)`` (the loop died), ``("stopped",)``.
The process ignores SIGINT / SIGTERM (the front end owns shutdown) and stops when the command
pipe closes, so it never outlives the server.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import select
import signal
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from pagedcore.serve.core_loop import Command, CoreLoop, EngineInfo
from pagedcore.serve.gc_control import freeze_startup_heap
from pagedcore.serve.step_trace import StepTrace

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.process import BaseProcess

    from pagedcore.engine.engine_args import EngineArgs

__all__ = ["EngineProcess", "run_engine_core"]

_HEADER = struct.Struct("<Q")


def _frame(message: Any) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


class _Frames:
    """Reassembles the frames read from a pipe (made non-blocking), whatever the chunks."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        os.set_blocking(fd, False)
        self._buffer = bytearray()

    def wait(self, timeout: float | None = None) -> None:
        """Until the pipe has something to read (or `timeout` seconds passed)."""
        select.select([self.fd], [], [], timeout)

    def read(self) -> bool:
        """Read what the pipe holds now; False at EOF (the other end closed)."""
        while True:
            try:
                chunk = os.read(self.fd, 1 << 22)
            except BlockingIOError:
                return True
            if not chunk:
                return False
            self._buffer += chunk

    def pop(self) -> list[Any]:
        """The complete messages read so far (removed from the buffer)."""
        buf, messages, start = self._buffer, [], 0
        while len(buf) - start >= _HEADER.size:
            (size,) = _HEADER.unpack_from(buf, start)
            end = start + _HEADER.size + size
            if len(buf) < end:
                break
            messages.append(pickle.loads(memoryview(buf)[start + _HEADER.size:end]))
            start = end
        del buf[:start]
        return messages


#: Bytes the engine's output pipe may hold (Linux; the default is 64 KiB): at stream interval
#: 1 a step's frame is a few KiB per hundred streams, so the default holds only a few steps, and
#: the engine blocks on its write while the front end's event loop is busy; 1 MiB (the largest
#: an unprivileged process may ask for by default) holds ~100.
PIPE_BYTES = 1 << 20


def _grow_pipe(fd: int) -> None:
    """Ask for a `PIPE_BYTES` pipe buffer where the platform allows it (else keep its own)."""
    try:
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
    except (ImportError, OSError):
        pass


def run_engine_core(args: EngineArgs, commands: Connection, out: Connection,
                    threads: int | None, stream_interval: int) -> None:
    """The engine process: build the `LLM` from `args`, then run `CoreLoop` until told to
    stop or until the command pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    out_fd = out.fileno()
    _grow_pipe(out_fd)

    def send(message: tuple[Any, ...]) -> None:
        view = memoryview(_frame(message))
        while view:  # blocking: the front end always reads
            view = view[os.write(out_fd, view):]

    try:
        import torch

        from pagedcore.engine.llm import LLM
        from pagedcore.engine.stats_logging import configure_cli_logging

        if threads is not None:
            torch.set_num_threads(threads)
        configure_cli_logging(args)
        llm = LLM.from_engine_args(args)
        frozen = freeze_startup_heap()  # before serving: full collections skip the model
        send(("ready", attrs.evolve(EngineInfo.of(llm), frozen_objects=frozen)))
    except BaseException as exc:
        send(("failed", f"{exc}" if isinstance(exc, ValueError)
              else f"{type(exc).__name__}: {exc}", isinstance(exc, ValueError)))
        return

    frames = _Frames(commands.fileno())
    pending: deque[Command] = deque()

    def recv(block: bool) -> Command | None:
        if not pending:
            if block:
                frames.wait()
            alive = frames.read()
            pending.extend(frames.pop())
            if not alive and not pending:
                return ("stop",)  # the front end is gone
        return pending.popleft() if pending else None

    try:
        CoreLoop(llm, lambda items, stats: send(("step", items, stats)),
                 stream_interval=stream_interval, trace=StepTrace.from_env()).run(recv)
        send(("stopped",))
    except BaseException as exc:
        logging.getLogger(__name__).exception("the engine loop stopped")
        try:
            send(("dead", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
    finally:
        shutdown = getattr(llm.runner, "shutdown", None)
        if callable(shutdown):
            shutdown()


class EngineProcess:
    """Start the engine process and wait until it is ready (or raise why it is not).

    Parameters
    ----------
    args:
        The engine's arguments (`EngineArgs`), as for `LLM.from_engine_args`.
    threads:
        torch CPU threads in the engine process (None: torch's default).
    stream_interval:
        See `CoreLoop`.

    Raises
    ------
    ValueError
        The engine refused `args` (the message says why: a model, length or KV budget).
    RuntimeError
        The engine process failed otherwise, or exited before it was ready.
    """

    def __init__(self, args: EngineArgs, *, threads: int | None = None,
                 stream_interval: int = 1) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: CUDA-safe
        cmd_recv, self._cmd = ctx.Pipe(duplex=False)
        self._out, out_send = ctx.Pipe(duplex=False)
        # Not a daemon: the engine may start processes of its own (tensor-parallel workers).
        self.process: BaseProcess = ctx.Process(
            target=run_engine_core, args=(args, cmd_recv, out_send, threads, stream_interval),
            name="pagedcore-engine-core")
        self.process.start()
        cmd_recv.close()
        out_send.close()
        self._frames = _Frames(self._out.fileno())
        self._cmd_fd = self._cmd.fileno()
        os.set_blocking(self._cmd_fd, False)
        self._wbuf = bytearray()  # commands the pipe has not taken yet
        self._lock = threading.Lock()
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_message: Callable[[tuple[Any, ...]], None] | None = None
        message = self._read_blocking()
        if message[0] == "failed":
            self.process.join(30)
            if message[2]:
                raise ValueError(message[1])
            raise RuntimeError(f"the engine process failed to start: {message[1]}")
        self.info: EngineInfo = message[1]

    def _read_blocking(self) -> tuple[Any, ...]:
        while True:
            messages = self._frames.pop()
            if messages:
                message: tuple[Any, ...] = messages[0]
                return message
            self._frames.wait()
            if not self._frames.read():
                self.process.join(30)
                raise RuntimeError(f"the engine process exited (code {self.process.exitcode})"
                                   " before it was ready")

    @property
    def attached(self) -> bool:
        """True once `attach` was called."""
        return self._loop is not None

    @property
    def alive(self) -> bool:
        """True while the process runs."""
        return self.process.is_alive()

    def attach(self, loop: asyncio.AbstractEventLoop,
               on_message: Callable[[tuple[Any, ...]], None]) -> None:
        """Read the process's messages on `loop` from now on, calling `on_message` for each
        (``("eof", exitcode)`` once the process is gone)."""
        self._loop, self._on_message = loop, on_message
        loop.add_reader(self._frames.fd, self._readable)

    def _readable(self) -> None:
        assert self._on_message is not None and self._loop is not None
        alive = self._frames.read()
        for message in self._frames.pop():
            self._on_message(message)
        if not alive:
            self._loop.remove_reader(self._frames.fd)
            self.process.join(5)
            self._on_message(("eof", self.process.exitcode))

    def send(self, command: Command) -> None:
        """Queue a command for the engine process without blocking (any thread); after the
        process is gone it is dropped (its end arrives as ``eof``)."""
        with self._lock:
            if self._closed:
                return
            self._wbuf += _frame(command)
            self._flush_locked()

    def _flush_locked(self, *, then_wait: bool = True) -> None:
        try:
            while self._wbuf:
                self._wbuf = self._wbuf[os.write(self._cmd_fd, self._wbuf):]
        except BlockingIOError:  # the pipe is full: the rest when it drains
            if then_wait:
                self._when_writable()
        except OSError:  # the process is gone
            self._wbuf.clear()

    def _when_writable(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            loop.add_writer(self._cmd_fd, self._writable)
        else:
            loop.call_soon_threadsafe(loop.add_writer, self._cmd_fd, self._writable)

    def _writable(self) -> None:
        assert self._loop is not None
        with self._lock:
            self._loop.remove_writer(self._cmd_fd)
            if not self._closed:
                self._flush_locked()

    def close(self, *, timeout: float = 60.0) -> None:
        """Ask the process to stop (it aborts what runs), wait for it, then kill it if it has
        not exited within `timeout` seconds (blocking)."""
        self.send(("stop",))
        loop = self._loop
        if loop is None or not loop.is_running():
            # Nobody flushes or reads for us: push the commands out and drain the process's
            # messages here (dropped) until it exits, both at once (either pipe may be full).
            deadline = time.monotonic() + timeout
            while self.process.is_alive() and time.monotonic() < deadline:
                with self._lock:
                    writing = [self._cmd_fd] if self._wbuf else []
                readable, writable, _ = select.select([self._frames.fd], writing, [], 0.1)
                if writable:
                    with self._lock:
                        self._flush_locked(then_wait=False)
                if readable:
                    if not self._frames.read():
                        break
                    self._frames.pop()
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        with self._lock:
            self._closed = True
            self._wbuf.clear()
            self._cmd.close()

    def detach(self) -> None:
        """Stop reading (on the loop's thread)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._frames.fd)
            self._loop.remove_writer(self._cmd_fd)
        self._out.close()
