"""`AsyncEngine`: one engine loop on a background thread or process, async iterators per request.

The engine loop (`pagedcore.serve.core_loop.CoreLoop`) owns the `LLM`: every engine call
(`add_request`, `step`, `abort`) happens there, so the scheduler and the KV-cache manager are
never touched concurrently. It runs on a thread of this process (``AsyncEngine(llm)``) or in
a process of its own (``AsyncEngine.spawn(engine_args)``, what `pagedcore serve` does: the
engine then never waits for the event loop's GIL). Coroutines talk to it through commands
(``add`` / ``abort`` / ``stop``) and receive each step's `StreamDelta`s on their own
`asyncio.Queue`.

`generate()` yields the deltas of one sequence: the new tokens, their text, and a finish
reason as OpenAI defines it; when its consumer fell behind, the deltas waiting are merged into
one. The text and the stop strings are the engine's own (`pagedcore.engine.detokenizer`,
driven by the request's `SamplingParams`): the engine detokenizes incrementally and stops a
request when its text matches. A consumer that goes away (the iterator closed, its task
cancelled: a client disconnect) aborts its engine request at once, which frees its KV blocks.
Admission control bounds the requests in flight: past ``max_num_seqs + max_waiting`` new ones
get `QueueFullError` (HTTP 503 with ``Retry-After``); nothing admitted is ever dropped for it.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import AsyncGenerator, Sequence
from typing import TYPE_CHECKING, Any

from pagedcore.serve.core_loop import EngineInfo
from pagedcore.serve.deltas import CoreError, StreamDelta, merge_raw_deltas
from pagedcore.serve.engine_thread import EngineThread, RequestStream
from pagedcore.serve.errors import (
    BadRequestError,
    EngineDeadError,
    QueueFullError,
    ShuttingDownError,
)

if TYPE_CHECKING:
    from pagedcore.engine.engine_args import EngineArgs
    from pagedcore.engine.llm import LLM
    from pagedcore.engine.sampling.sampling_params import SamplingParams
    from pagedcore.serve.core_loop import Command
    from pagedcore.serve.engine_process import EngineProcess
    from pagedcore.serve.metrics import ServeMetrics

__all__ = ["AsyncEngine", "StreamDelta", "Submission"]

_FINISH = StreamDelta._fields.index("finish_reason")


class AsyncEngine(EngineThread):
    """An `LLM` driven by a background thread (or process), for asyncio servers.

    Parameters
    ----------
    llm:
        The engine, run on a thread of this process. The `AsyncEngine` owns it from now on
        (call nothing on it directly); its tokenizer stays with it (the engine detokenizes)
        and is shared as `AsyncEngine.tokenizer` (chat templates, logprob token texts).
        Use `AsyncEngine.spawn` instead to run the engine in its own process.
    max_waiting:
        Requests admitted beyond ``max_num_seqs`` (those wait in the queue); past it new
        requests are refused with `QueueFullError`.
    metrics:
        Where to record latencies and token counts (None: nowhere).
    retry_after:
        Seconds the ``Retry-After`` header of a refusal suggests.
    stream_interval:
        Steps between two deltas of a running sequence (see `CoreLoop`).
    process:
        Instead of `llm` (then None): a started engine process (`AsyncEngine.spawn` makes
        one and passes it here).

    Examples
    --------
    >>> engine = AsyncEngine(LLM("demo", device="cpu")); engine.start()  # doctest: +SKIP
    >>> async for delta in engine.generate([1, 2, 3], SamplingParams(max_tokens=4)):
    ...     print(delta.text, delta.finish_reason)  # doctest: +SKIP
    """

    def __init__(
        self,
        llm: LLM | None,
        *,
        max_waiting: int = 1024,
        metrics: ServeMetrics | None = None,
        retry_after: int = 1,
        stream_interval: int = 1,
        process: EngineProcess | None = None,
    ) -> None:
        if not isinstance(max_waiting, int) or max_waiting < 0:
            raise ValueError(f"max_waiting must be an integer >= 0, got {max_waiting!r}")
        if (llm is None) == (process is None):
            raise ValueError("give AsyncEngine an LLM, or use AsyncEngine.spawn(engine_args)")
        if not isinstance(stream_interval, int) or stream_interval < 1:
            raise ValueError(f"stream_interval must be an integer >= 1, got {stream_interval!r}")
        self.llm = llm
        self._process = process
        self.stream_interval = stream_interval
        if llm is not None:
            info = EngineInfo.of(llm)
        else:
            assert process is not None
            info = process.info
        self.info = info
        self.tokenizer: Any = info.tokenizer
        self.model_name = info.model_name
        self.max_model_len = info.max_model_len
        self.max_num_seqs = info.max_num_seqs
        self.vocab_size = info.vocab_size
        self.capacity = self.max_num_seqs + max_waiting
        self.metrics = metrics
        self.retry_after = retry_after
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # requests in flight, by engine id
        self._lock = threading.Lock()
        self._in_flight = 0
        self._accepting = True
        self._dead: str | None = None
        self._loop_done = False
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stats: dict[str, Any] = {"running": 0, "waiting": 0}

    @classmethod
    def spawn(cls, args: EngineArgs, *, threads: int | None = None,
              max_waiting: int = 1024, metrics: ServeMetrics | None = None,
              retry_after: int = 1, stream_interval: int = 1) -> AsyncEngine:
        """An `AsyncEngine` whose engine runs in a process of its own, built from `args`
        (blocks until the model is loaded; see `pagedcore.serve.engine_process`).

        `start` must then be called on the event loop that serves the requests (a FastAPI
        lifespan does), and every request must come from that loop. The process is started
        with ``spawn``: as with any spawned process, a script calling this needs the
        ``if __name__ == "__main__":`` guard (the child imports the script's main module).

        Raises
        ------
        ValueError
            The engine refused `args` (a model, length or KV budget; the message says why).
        RuntimeError
            The engine process failed otherwise.
        """
        from pagedcore.serve.engine_process import EngineProcess

        if not isinstance(stream_interval, int) or stream_interval < 1:
            raise ValueError(f"stream_interval must be an integer >= 1, got {stream_interval!r}")
        process = EngineProcess(args, threads=threads, stream_interval=stream_interval)
        return cls(None, process=process, max_waiting=max_waiting, metrics=metrics,
                   retry_after=retry_after, stream_interval=stream_interval)

    @property
    def backend_names(self) -> tuple[str, ...]:
        """The attention backends the engine runs."""
        return self.info.backend_names

    @property
    def device(self) -> str:
        """The engine's device."""
        return self.info.device

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread, or with an engine process start reading it on the running
        event loop (idempotent)."""
        if self._process is not None:
            if not self._process.attached:
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:
                    raise RuntimeError("AsyncEngine.spawn(...).start() must be called on the "
                                       "event loop that serves the requests") from None
                self._process.attach(loop, self._on_message)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pagedcore-engine",
                                            daemon=True)
            self._thread.start()

    def _on_message(self, message: tuple[Any, ...]) -> None:
        """On the event loop: one message of the engine process."""
        kind = message[0]
        if kind == "step":
            if message[2] is not None:
                self._stats = message[2]
            streams = self._streams
            for rid, item in message[1]:
                stream = streams.get(rid)
                if stream is not None:
                    stream.push(item)
            return
        if kind == "dead":
            self._dead = str(message[1])
            error = CoreError("dead", f"the engine stopped after a failure: {self._dead}")
        elif kind == "eof" and not self._loop_done:
            self._dead = f"the engine process exited (code {message[1]})"
            error = CoreError("dead", f"the engine stopped after a failure: {self._dead}")
        else:  # "stopped", or the end of a process that stopped
            error = CoreError("shutdown", "the server shut down")
        self._loop_done = True
        for stream in list(self._streams.values()):
            stream.push(error)

    @property
    def is_running(self) -> bool:
        """True while the engine loop serves requests."""
        if self._process is not None:
            return self._process.alive and self._dead is None and not self._loop_done
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    @property
    def dead_reason(self) -> str | None:
        """Why the engine loop stopped after a failure, or None."""
        return self._dead

    @property
    def num_in_flight(self) -> int:
        """Requests admitted and not finished."""
        return self._in_flight

    def stats(self) -> dict[str, Any]:
        """The engine's last stats snapshot (`LLM.stats` keys); ``waiting`` counts requests
        admitted but not running yet."""
        stats = dict(self._stats)
        stats["waiting"] = max(0, self._in_flight - int(stats.get("running", 0)))
        return stats

    async def shutdown(self, *, timeout: float = 30.0) -> None:
        """Stop admitting, let in-flight requests finish for up to `timeout` seconds, abort
        the rest, and stop the engine loop (and tensor-parallel workers)."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self._in_flight and time.monotonic() < deadline and self.is_running:
            await asyncio.sleep(0.02)
        await asyncio.get_running_loop().run_in_executor(None, self.close)
        if self._process is not None:
            self._process.detach()

    def close(self) -> None:
        """Abort whatever is in flight and stop the engine loop now (blocking)."""
        self._accepting = False
        if self._process is not None:
            self._process.close()
            return
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(("stop",))
            self._thread.join()
        assert self.llm is not None
        shutdown = getattr(self.llm.runner, "shutdown", None)
        if callable(shutdown):
            shutdown()

    def _send(self, command: Command) -> None:
        if self._process is not None:
            self._process.send(command)
        else:
            self._commands.put(command)

    # ---- admission -------------------------------------------------------------------------

    def reserve(self, count: int = 1) -> None:
        """Admit `count` sequences (all or none); `release` gives each slot back.

        Raises
        ------
        BadRequestError
            `count` is more than the capacity itself (it could never be admitted).
        QueueFullError
            Admitting them would pass ``max_num_seqs + max_waiting`` sequences in flight.
        ShuttingDownError, EngineDeadError
            The server is stopping, or the engine loop died.
        """
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped after a failure: {self._dead}")
        if count > self.capacity:
            # Never admissible, however long the client waits: not a 503 to retry.
            raise BadRequestError(
                f"the request needs {count} sequences (prompts x n) and this server runs at "
                f"most {self.capacity} at once (--max-num-seqs + --max-waiting); send fewer "
                "prompts or a smaller n per request", param="n", code="too_many_sequences")
        if not self._accepting:
            raise ShuttingDownError("the server is shutting down and admits no new requests")
        with self._lock:
            if self._in_flight + count > self.capacity:
                if self.metrics is not None:
                    self.metrics.refused()
                raise QueueFullError(
                    f"the server is at capacity ({self._in_flight} sequences in flight, at "
                    f"most {self.capacity} = --max-num-seqs + --max-waiting); retry after "
                    f"{self.retry_after} s", retry_after=self.retry_after,
                )
            self._in_flight += count

    def release(self, count: int = 1) -> None:
        """Give back `count` slots taken by `reserve`."""
        with self._lock:
            self._in_flight = max(0, self._in_flight - count)

    def check_prompt(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """BadRequestError when a prompt of this length can never be served."""
        if num_prompt_tokens == 0:
            raise BadRequestError("the prompt is empty; give at least one token",
                                  param="prompt", code="invalid_value")
        try:
            self.info.fit.check(num_prompt_tokens, max_tokens)
        except ValueError as exc:
            raise BadRequestError(str(exc), param="prompt", code="context_length_exceeded") \
                from exc

    # ---- requests --------------------------------------------------------------------------

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        reserved: bool = False,
    ) -> AsyncGenerator[StreamDelta, None]:
        """Run one sequence (``params.n == 1``): it goes to the engine at once (`submit`);
        the returned iterator yields a `StreamDelta` whenever it advances (`deltas`).

        Call it on the event loop. Sending the request before anything iterates matters to a
        server taking a burst of requests: each handler reaches the engine as soon as its
        body is parsed, not after every other request of the burst has been parsed too (the
        event loop runs the handlers' steps in turn).

        Parameters
        ----------
        prompt_token_ids:
            The prompt, tokenized.
        params:
            Sampling parameters (``n`` must be 1: fan samples out as separate sequences);
            their ``stop`` strings, ``skip_special_tokens`` etc. act in the engine.
        request_id:
            The engine request id (None: a fresh one).
        reserved:
            A slot was already taken with `reserve` (it is released here either way).

        Raises
        ------
        QueueFullError, ShuttingDownError, EngineDeadError
            Not admitted (see `reserve`), here.
        BadRequestError
            The engine refused the request (e.g. a token id outside the vocabulary), while
            iterating.
        RequestFailedError
            The engine step computing it failed, while iterating.
        """
        return self.deltas(self.submit(prompt_token_ids, params, request_id=request_id,
                                       reserved=reserved))

    def submit(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        reserved: bool = False,
    ) -> Submission:
        """Admit one sequence and send it to the engine now; `deltas` iterates its output.
        A submission nobody iterates is aborted once it is garbage (its slot given back).
        Arguments and admission errors as `generate`."""
        if params.n != 1:
            if reserved:
                self.release(1)
            raise ValueError("AsyncEngine.generate runs one sequence; pass n=1 per call")
        if not reserved:
            self.reserve(1)
        rid = request_id if request_id is not None else f"serve-{next(self._ids)}"
        stream = RequestStream(asyncio.get_running_loop())
        self._streams[rid] = stream
        self._send(("add", rid, list(prompt_token_ids), params))
        if self._loop_done:
            # The loop ended before or while we queued: it may never read the command
            # (it sets the flag before answering the streams, so one of the two answers).
            self._streams.pop(rid, None)
            self.release(1)
            raise EngineDeadError(f"the engine stopped after a failure: {self._dead}") \
                if self._dead else ShuttingDownError("the server shut down")
        return Submission(self, rid, stream)

    async def deltas(self, submission: Submission) -> AsyncGenerator[StreamDelta, None]:
        """The deltas of a `submit`-ted sequence, until it finishes; closing the iterator
        early (a consumer gone) aborts the engine request. Raises as `generate` does while
        iterating."""
        submission.claimed = True
        rid, stream, start = submission.request_id, submission.stream, submission.start
        first_token: float | None = None
        done = False
        try:
            while True:
                # Behind the engine (a slow client, a busy event loop): every delta waiting
                # is merged into one.
                raws = []
                for raw in await stream.take():
                    if isinstance(raw, CoreError):
                        done = True
                        raise raw.to_exception()
                    raws.append(raw)
                    if raw[_FINISH] is not None:
                        break
                item = merge_raw_deltas(raws)
                if item.token_ids and first_token is None:
                    first_token = time.perf_counter()
                if item.finish_reason is not None:
                    done = True
                    self._record(start, first_token, item.num_prompt_tokens,
                                 item.num_generated_tokens, item.finish_reason)
                yield item
                if done:
                    return
        finally:
            self._streams.pop(rid, None)
            if not done:  # the consumer went away (client disconnect, task cancelled)
                self._abandon(rid)
            self.release(1)

    def _abandon(self, rid: str) -> None:
        """Abort `rid` in the engine (its consumer is gone)."""
        self._send(("abort", rid))
        if self.metrics is not None:
            self.metrics.finished("abort")

    def _record(self, start: float, first_token: float | None, num_prompt: int,
                num_generated: int, reason: str | None) -> None:
        metrics = self.metrics
        if metrics is None:
            return
        end = time.perf_counter()
        metrics.prompt_tokens.inc(num_prompt)
        metrics.generation_tokens.inc(num_generated)
        metrics.e2e.observe(end - start)
        if first_token is not None:
            metrics.ttft.observe(first_token - start)
            if num_generated > 1:
                metrics.tpot.observe((end - first_token) / (num_generated - 1))
        metrics.finished(reason or "abort")


class Submission:
    """A sequence sent to the engine by `AsyncEngine.submit`, whose deltas `deltas` yields.

    Attributes
    ----------
    request_id:
        The engine request id.
    stream:
        Where the engine loop's items for it arrive.
    start:
        ``time.perf_counter()`` at submission (TTFT and e2e count from here).
    claimed:
        `deltas` took it over (its end, abort and slot are then handled there).
    """

    __slots__ = ("claimed", "engine", "request_id", "start", "stream")

    def __init__(self, engine: AsyncEngine, request_id: str, stream: RequestStream) -> None:
        self.engine = engine
        self.request_id = request_id
        self.stream = stream
        self.start = time.perf_counter()
        self.claimed = False

    def __del__(self) -> None:
        # Submitted but never iterated (the client left before its response started, a
        # handler failed in between): abort it and give its slot back, or both would be lost.
        if not getattr(self, "claimed", True):
            self.claimed = True
            engine = self.engine
            if engine._streams.pop(self.request_id, None) is not None:
                engine._abandon(self.request_id)
            engine.release(1)
