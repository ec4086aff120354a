"""Serving: an async front end over the engine and an OpenAI-compatible HTTP server.

`pagedcore.serve.async_engine.AsyncEngine` runs the `LLM` on a background thread and hands
out async iterators per request; `pagedcore.serve.app.build_app` is the FastAPI application
(``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``);
``pagedcore serve MODEL`` runs it on uvicorn. The web stack (fastapi, uvicorn,
prometheus-client) is the ``serve`` extra and is imported only by those modules.
"""

from __future__ import annotations

__all__: list[str] = []
