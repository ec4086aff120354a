"""The FastAPI application: OpenAI-compatible routes, health, metrics and error handling.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream: true`` as
server-sent events), ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info`` (when
enabled), ``GET /v1/models``, ``GET /health``, ``GET /metrics``. Every error is
OpenAI's ``{"error": {"message", "type", "param", "code"}}`` with its HTTP status; the server
keeps serving after any of them.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

# This module is the web layer: it imports the web stack (the `serve` extra) at the top, since
# FastAPI resolves the handlers' annotations from these globals.
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.responses import Response

from pagedcore.serve.errors import (
    AuthenticationError,
    PayloadTooLargeError,
    ServeError,
    error_body,
)
from pagedcore.serve.json_body import parse_body
from pagedcore.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagedcore.serve.serving import OpenAIServing

if TYPE_CHECKING:
    from pagedcore.serve.async_engine import AsyncEngine
    from pagedcore.serve.metrics import ServeMetrics

__all__ = ["DEFAULT_MAX_BODY_BYTES", "build_app"]

#: Seconds between checks that the client of a non-streaming request is still there.
_DISCONNECT_POLL_S = 0.25

#: Largest request body accepted (a model-length prompt of token ids is far smaller).
DEFAULT_MAX_BODY_BYTES = 4 * 2**20

_STATUS_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                 404: "not_found_error", 405: "invalid_request_error",
                 413: "invalid_request_error", 500: "internal_server_error"}


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, or PayloadTooLargeError past `limit` bytes (the rest is read and dropped, so
    the client gets the 413 rather than a reset connection)."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
    if size > limit:
        raise PayloadTooLargeError(
            f"the request body has {size} bytes, more than this server accepts ({limit}); "
            "send a shorter prompt (or start the server with a larger --max-request-bytes)",
            code="request_too_large")
    return b"".join(chunks)


async def _unless_disconnected(request: Request, work: Awaitable[dict[str, Any]]) -> Response:
    """Await a non-streaming response; if the client goes away first, cancel it (which
    aborts its engine requests) instead of generating for nobody."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return JSONResponse(task.result())
            if await request.is_disconnected():
                task.cancel()
                return Response(status_code=499)  # nobody reads it (nginx's "client closed")
    finally:
        if not task.done():
            task.cancel()


def build_app(
    engine: AsyncEngine,
    *,
    model_names: Sequence[str],
    api_key: str | None = None,
    metrics: ServeMetrics | None = None,
    max_n: int | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    shutdown_timeout: float = 30.0,
    on_shutdown: Callable[[str], None] | None = None,
    chat_template: str | None = None,
    enable_tokenizer_info_endpoint: bool = False,
) -> FastAPI:
    """The server's FastAPI application over a (not yet started) `AsyncEngine`.

    Parameters
    ----------
    engine:
        Started when the application starts; shut down gracefully when it stops (stop
        admitting, let in-flight requests finish for `shutdown_timeout` seconds, abort the
        rest).
    model_names:
        Names accepted in the ``model`` field (the first one is reported).
    api_key:
        When set, ``/v1/*``, ``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` requests need
        ``Authorization: Bearer <api_key>`` (else 401).
    metrics:
        Served at ``/metrics`` (None: the route answers 404).
    max_n:
        Most samples per prompt (None: the engine's ``max_num_seqs``).
    max_body_bytes:
        Larger bodies get 413.
    on_shutdown:
        Called with a one-line summary once the engine has stopped.
    chat_template:
        A Jinja chat template for /v1/chat/completions instead of the tokenizer's.
    enable_tokenizer_info_endpoint:
        Serve ``GET /tokenizer_info`` (vLLM's flag of the same name; off: the route is 404).
    """
    if not model_names:
        raise ValueError("model_names must name at least one model")
    serving = OpenAIServing(
        engine, model_names=model_names,
        max_n=max_n if max_n is not None else engine.max_num_seqs,
        chat_template=chat_template,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        in_flight = engine.num_in_flight
        await engine.shutdown(timeout=shutdown_timeout)
        if on_shutdown is not None:
            on_shutdown(f"engine stopped ({in_flight} request(s) in flight at shutdown, "
                        f"{engine.num_in_flight} aborted)")

    app = FastAPI(title="pagedcore", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.serving = serving

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise AuthenticationError("a valid API key is needed: send the header "
                                      "'Authorization: Bearer <key>'", code="invalid_api_key")

    @app.exception_handler(ServeError)
    async def serve_error(request: Request, exc: ServeError) -> Response:
        return JSONResponse(error_body(exc.message, type=exc.type, param=exc.param,
                                       code=exc.code), status_code=exc.status,
                            headers=exc.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        return JSONResponse(error_body(str(exc.detail),
                                       type=_STATUS_TYPES.get(exc.status_code, "error")),
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}",
                                       type="internal_server_error"), status_code=500)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        check_key(request)
        body = parse_body(CompletionRequest, await _read_body(request, max_body_bytes))
        fan, prompts = serving.completion(body, await serving.completion_prompts(body))
        if body.stream:
            return StreamingResponse(serving.completion_stream(body, fan, prompts),
                                     media_type="text/event-stream")
        return await _unless_disconnected(request,
                                          serving.completion_response(body, fan, prompts))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        check_key(request)
        body = parse_body(ChatCompletionRequest, await _read_body(request, max_body_bytes))
        fan, prompts = serving.chat(body, await serving.chat_prompts(body))
        if body.stream:
            return StreamingResponse(serving.chat_stream(body, fan, prompts),
                                     media_type="text/event-stream")
        return await _unless_disconnected(request, serving.chat_response(body, fan, prompts))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        check_key(request)
        body = parse_body(TokenizeRequest, await _read_body(request, max_body_bytes))
        return await serving.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        check_key(request)
        return serving.detokenize(parse_body(DetokenizeRequest,
                                             await _read_body(request, max_body_bytes)))

    if enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def tokenizer_info(request: Request) -> dict[str, Any]:
            check_key(request)
            return serving.tokenizer_info()

    created = int(time.time())

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        check_key(request)
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "pagedcore",
             "root": engine.model_name, "max_model_len": engine.max_model_len}
            for name in model_names]}

    @app.get("/health")
    async def health() -> Response:
        if engine.is_running:
            return JSONResponse({"status": "ok"})
        reason = engine.dead_reason or "the engine is not running"
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)

    @app.get("/metrics")
    async def metrics_route() -> Response:
        if metrics is None:
            raise HTTPException(404, "metrics are off")
        content, content_type = metrics.render()
        return Response(content, media_type=content_type)

    return app
