"""`AsyncEngine`: one engine loop on a background thread, async iterators per request.

The loop thread owns the `LLM`: every engine call (`add_request`, `step`, `abort`) happens on
it, so the scheduler and the KV-cache manager are never touched concurrently. Coroutines talk
to it through a command queue (``add`` / ``abort`` / ``stop``) and receive each step's outputs on
their own `asyncio.Queue` (handed over with `loop.call_soon_threadsafe`).

`generate()` turns the cumulative engine outputs of one sequence into `StreamDelta`s: the new
tokens, their text, and a finish reason as OpenAI defines it. The text and the stop strings are
the engine's own (`pagedcore.engine.detokenizer`, driven by the request's `SamplingParams`):
the engine detokenizes incrementally and stops a request when its text matches. A
consumer that goes away (the iterator closed, its task cancelled: a client disconnect) aborts
its engine request at once, which frees its KV blocks. Admission control bounds the requests in
flight: past ``max_num_seqs + max_waiting`` new ones get `QueueFullError` (HTTP 503 with
``Retry-After``); nothing admitted is ever dropped for it.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import AsyncGenerator, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from pagedcore.serve.engine_thread import EngineThread, RequestStream
from pagedcore.serve.errors import (
    BadRequestError,
    EngineDeadError,
    QueueFullError,
    RequestFailedError,
    ShuttingDownError,
)

if TYPE_CHECKING:
    from pagedcore.engine.llm import LLM
    from pagedcore.engine.outputs import Logprob, RequestOutput
    from pagedcore.engine.sampling.sampling_params import SamplingParams
    from pagedcore.serve.metrics import ServeMetrics

__all__ = ["AsyncEngine", "StreamDelta"]


@attrs.frozen(kw_only=True)
class StreamDelta:
    """What one sequence produced since the previous delta.

    Attributes
    ----------
    request_id:
        The engine request id.
    text:
        New text (complete characters only; the part that could still become a stop string is
        held back).
    token_ids:
        New token ids.
    logprobs:
        Per new token ``{token_id: Logprob}`` (the sampled token and the top ones), or None.
    finish_reason:
        None while running; then ``"stop"`` (EOS, a stop token or a stop string), ``"length"``
        (max_tokens or the model length) or ``"abort"`` (the server stopped it).
    stop_reason:
        The EOS / stop token id or the stop string that ended the sequence, or None.
    num_prompt_tokens, num_cached_tokens, num_generated_tokens:
        Prompt tokens, those served from the prefix cache, tokens generated so far (all of the
        sequence, not only this delta's).
    prompt_logprobs:
        With ``SamplingParams.prompt_logprobs``: `RequestOutput.prompt_logprobs`, in the first
        delta after the prompt was computed only; else None.
    """

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_generated_tokens: int
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class AsyncEngine(EngineThread):
    """An `LLM` driven by a background thread, for asyncio servers.

    Parameters
    ----------
    llm:
        The engine. The `AsyncEngine` owns it from now on (call nothing on it directly); its
        tokenizer stays with it (the engine detokenizes) and is shared as
        `AsyncEngine.tokenizer` (chat templates, logprob token texts).
    max_waiting:
        Requests admitted beyond ``max_num_seqs`` (those wait in the queue); past it new
        requests are refused with `QueueFullError`.
    metrics:
        Where to record latencies and token counts (None: nowhere).
    retry_after:
        Seconds the ``Retry-After`` header of a refusal suggests.

    Examples
    --------
    >>> engine = AsyncEngine(LLM("demo", device="cpu")); engine.start()  # doctest: +SKIP
    >>> async for delta in engine.generate([1, 2, 3], SamplingParams(max_tokens=4)):
    ...     print(delta.text, delta.finish_reason)  # doctest: +SKIP
    """

    def __init__(
        self,
        llm: LLM,
        *,
        max_waiting: int = 1024,
        metrics: ServeMetrics | None = None,
        retry_after: int = 1,
    ) -> None:
        if not isinstance(max_waiting, int) or max_waiting < 0:
            raise ValueError(f"max_waiting must be an integer >= 0, got {max_waiting!r}")
        self.llm = llm
        self.tokenizer: Any = llm.tokenizer
        self.max_model_len = int(llm.max_model_len)
        self.capacity = int(llm.scheduler_config.max_num_seqs) + max_waiting
        self.metrics = metrics
        self.retry_after = retry_after
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._lock = threading.Lock()
        self._in_flight = 0
        self._accepting = True
        self._dead: str | None = None
        self._loop_done = False
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stats: dict[str, Any] = {"running": 0, "waiting": 0}
        self._stats_time = 0.0

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pagedcore-engine",
                                            daemon=True)
            self._thread.start()

    @property
    def is_running(self) -> bool:
        """True while the engine thread serves requests."""
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
        the rest, and stop the engine thread (and tensor-parallel workers)."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self._in_flight and time.monotonic() < deadline and self.is_running:
            await asyncio.sleep(0.02)
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    def close(self) -> None:
        """Abort whatever is in flight and stop the engine thread now (blocking)."""
        self._accepting = False
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(("stop",))
            self._thread.join()
        shutdown = getattr(self.llm.runner, "shutdown", None)
        if callable(shutdown):
            shutdown()

    # ---- admission -------------------------------------------------------------------------

    def reserve(self, count: int = 1) -> None:
        """Admit `count` sequences (all or none); `release` gives each slot back.

        Raises
        ------
        QueueFullError
            Admitting them would pass ``max_num_seqs + max_waiting`` sequences in flight.
        ShuttingDownError, EngineDeadError
            The server is stopping, or the engine loop died.
        """
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped after a failure: {self._dead}")
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
        try:
            self.llm.scheduler.check_fits(num_prompt_tokens, max_tokens)  # config only
        except ValueError as exc:
            raise BadRequestError(str(exc), param="prompt", code="context_length_exceeded") \
                from exc

    # ---- requests --------------------------------------------------------------------------

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        reserved: bool = False,
    ) -> AsyncGenerator[StreamDelta, None]:
        """Run one sequence (``params.n == 1``); yield a `StreamDelta` whenever it advances.

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
            Not admitted (see `reserve`).
        BadRequestError
            The engine refused the request (e.g. a token id outside the vocabulary).
        RequestFailedError
            The engine step computing it failed.
        """
        if params.n != 1:
            raise ValueError("AsyncEngine.generate runs one sequence; pass n=1 per call")
        if not reserved:
            self.reserve(1)
        rid = request_id if request_id is not None else f"serve-{next(self._ids)}"
        stream = RequestStream(asyncio.get_running_loop())
        start = time.perf_counter()
        first_token: float | None = None
        seen = 0
        seen_chars = 0
        prompt_sent = False
        done = False
        try:
            self._commands.put(("add", rid, list(prompt_token_ids), params, stream))
            if self._loop_done:
                # The loop ended before or while we queued: it may never read the command
                # (it sets the flag before its final drain, so one of the two answers).
                done = True
                raise EngineDeadError(f"the engine stopped after a failure: {self._dead}") \
                    if self._dead else ShuttingDownError("the server shut down")
            while True:
                item = await stream.queue.get()
                while not stream.queue.empty():  # outputs are cumulative: the latest is enough
                    newer = stream.queue.get_nowait()
                    if not isinstance(item, BaseException):
                        item = newer
                if isinstance(item, BaseException):
                    done = True
                    raise item
                out: RequestOutput = item
                completion = out.outputs[0]
                new_ids = completion.token_ids[seen:]
                new_logprobs = None
                if completion.logprobs is not None:
                    new_logprobs = completion.logprobs[seen : len(completion.token_ids)]
                seen = len(completion.token_ids)
                if new_ids and first_token is None:
                    first_token = time.perf_counter()
                text = completion.text[seen_chars:]
                seen_chars = len(completion.text)
                reason = completion.finish_reason
                if reason is not None:
                    done = True
                    if reason == "error":
                        raise RequestFailedError(
                            f"the engine failed while computing request {rid!r}: "
                            f"{out.error or 'unknown error'}")
                if done:
                    self._record(start, first_token, len(out.prompt_token_ids), seen, reason)
                prompt_lps = None if prompt_sent else out.prompt_logprobs
                prompt_sent = prompt_sent or prompt_lps is not None
                yield StreamDelta(
                    request_id=rid, text=text, token_ids=list(new_ids), logprobs=new_logprobs,
                    finish_reason=reason, stop_reason=completion.stop_reason,
                    num_prompt_tokens=len(out.prompt_token_ids),
                    num_cached_tokens=out.num_cached_tokens, num_generated_tokens=seen,
                    prompt_logprobs=prompt_lps,
                )
                if done:
                    return
        finally:
            if not done:  # the consumer went away (client disconnect, task cancelled)
                self._commands.put(("abort", rid))
                if self.metrics is not None:
                    self.metrics.finished("abort")
            self.release(1)

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
