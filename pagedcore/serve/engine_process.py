"""The engine in a process of its own: `EngineProcess` (the front end's side) and
`run_engine_core` (the process's body), which runs `CoreLoop` there.

Why a process: on a thread, the engine shares the GIL with the event loop that turns every
token of every stream into a server-sent event, and each waits for the other; a step with
hundreds of streams took ~3x longer than in `LLM.generate` (see docs/serving.md). In its own
process the engine steps at `LLM.generate`'s pace; the front end's event loop only unpickles
one message per step and feeds the streams, and a stream that falls behind gets the tokens
waiting for it merged into one chunk.

Wire format: commands go to the process over a `multiprocessing` pipe (small, one per request
event). Each step's items come back as one pickled frame (an 8-byte length, then the pickle)
on a second pipe, which the front end reads on its event loop (``loop.add_reader``) without a
thread: everything available is read in one call and dispatched at once. Messages:
``("ready", EngineInfo)``, ``("failed", message, is_user_error)`` (the engine could not be
built), ``("step", items, stats)``, ``("dead", reason)`` (the loop died), ``("stopped",)``.
The process ignores SIGINT / SIGTERM (the front end owns shutdown) and exits when the command
pipe closes, so it never outlives the server.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import signal
import struct
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pagedcore.serve.core_loop import Command, CoreLoop, EngineInfo

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.process import BaseProcess

    from pagedcore.engine.engine_args import EngineArgs

__all__ = ["EngineProcess", "run_engine_core"]

_HEADER = struct.Struct("<Q")


def _write_frame(fd: int, payload: bytes) -> None:
    view = memoryview(_HEADER.pack(len(payload)) + payload)
    while view:
        view = view[os.write(fd, view):]


def run_engine_core(args: EngineArgs, commands: Connection, out: Connection,
                    threads: int | None, stream_interval: int) -> None:
    """The engine process: build the `LLM` from `args`, then run `CoreLoop` until told to
    stop or until the command pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    fd = out.fileno()

    def send(message: tuple[Any, ...]) -> None:
        _write_frame(fd, pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    try:
        import torch

        from pagedcore.engine.llm import LLM
        from pagedcore.engine.stats_logging import configure_cli_logging

        if threads is not None:
            torch.set_num_threads(threads)
        configure_cli_logging(args)
        llm = LLM.from_engine_args(args)
        send(("ready", EngineInfo.of(llm)))
    except BaseException as exc:
        send(("failed", f"{exc}" if isinstance(exc, ValueError)
              else f"{type(exc).__name__}: {exc}", isinstance(exc, ValueError)))
        return

    def recv(block: bool) -> Command | None:
        try:
            if block or commands.poll():
                command: Command = commands.recv()
                return command
        except (EOFError, OSError):  # the front end is gone
            return ("stop",)
        return None

    try:
        CoreLoop(llm, lambda items, stats: send(("step", items, stats)),
                 stream_interval=stream_interval).run(recv)
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
        self._fd = self._out.fileno()
        self._buffer = bytearray()
        self._send_lock = threading.Lock()
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
            messages = self._frames()
            if messages:
                return messages[0]
            chunk = os.read(self._fd, 1 << 20)
            if not chunk:
                self.process.join(30)
                raise RuntimeError(f"the engine process exited (code {self.process.exitcode})"
                                   " before it was ready")
            self._buffer += chunk

    def _frames(self) -> list[tuple[Any, ...]]:
        """The complete messages in the buffer (removed from it)."""
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

    @property
    def alive(self) -> bool:
        """True while the process runs."""
        return self.process.is_alive()

    def attach(self, loop: asyncio.AbstractEventLoop,
               on_message: Callable[[tuple[Any, ...]], None]) -> None:
        """Read the process's messages on `loop` from now on, calling `on_message` for each
        (``("eof", exitcode)`` once the process is gone)."""
        self._loop, self._on_message = loop, on_message
        os.set_blocking(self._fd, False)
        loop.add_reader(self._fd, self._readable)

    def _readable(self) -> None:
        assert self._on_message is not None and self._loop is not None
        eof = False
        while True:  # everything there is now, in as few calls as it takes
            try:
                chunk = os.read(self._fd, 1 << 22)
            except BlockingIOError:
                break
            if not chunk:
                eof = True
                break
            self._buffer += chunk
        for message in self._frames():
            self._on_message(message)
        if eof:
            self._loop.remove_reader(self._fd)
            self.process.join(5)
            self._on_message(("eof", self.process.exitcode))

    def send(self, command: Command) -> None:
        """Queue a command in the engine process (any thread); a gone process is ignored
        (its end arrives as ``eof``)."""
        with self._send_lock:
            try:
                self._cmd.send(command)
            except (OSError, ValueError):
                pass

    def close(self, *, timeout: float = 60.0) -> None:
        """Ask the process to stop (it aborts what runs), wait for it, then kill it if it has
        not exited within `timeout` seconds (blocking)."""
        self.send(("stop",))
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        with self._send_lock:
            self._cmd.close()

    def detach(self) -> None:
        """Stop reading (on the loop's thread)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        self._out.close()

