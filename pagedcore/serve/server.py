"""Run the application on uvicorn: in the foreground (`pagedcore serve`) or on a thread."""

from __future__ import annotations

import socket
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = ["ServerThread", "free_port", "run_server", "server_stack"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def server_stack() -> tuple[str, str]:
    """The event loop and HTTP parser uvicorn runs: ``("uvloop", "httptools")`` when
    ``uvicorn[standard]`` is installed (pagedcore's ``serve`` extra), else the pure-Python
    ``("asyncio", "h11")``. On CPU the faster pair costs the server process ~20 % less CPU
    per streamed token (`docs/serving.md`)."""
    from importlib.util import find_spec

    return ("uvloop" if find_spec("uvloop") else "asyncio",
            "httptools" if find_spec("httptools") else "h11")


def _config(app: FastAPI, *, host: str, port: int, log_level: str,
            shutdown_timeout: float) -> Any:
    import uvicorn

    # One worker process and one event loop: the engine owns the GPU, and the loop only moves
    # bytes; `timeout_graceful_shutdown` bounds how long SIGTERM waits for open streams.
    loop, http = server_stack()
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                          timeout_graceful_shutdown=int(max(1, shutdown_timeout)),
                          lifespan="on", loop=loop, http=http)


def run_server(app: FastAPI, *, host: str, port: int, log_level: str = "info",
               shutdown_timeout: float = 30.0) -> None:
    """Serve `app` until SIGINT / SIGTERM (graceful: uvicorn stops accepting, open requests
    get `shutdown_timeout` seconds, then the engine aborts the rest and stops)."""
    import uvicorn

    uvicorn.Server(_config(app, host=host, port=port, log_level=log_level,
                           shutdown_timeout=shutdown_timeout)).run()


class ServerThread:
    """`app` served on a background thread (tests, notebooks); `stop()` shuts it down.

    Examples
    --------
    >>> server = ServerThread(app, port=free_port()).start()  # doctest: +SKIP
    >>> server.url  # doctest: +SKIP
    'http://127.0.0.1:...'
    >>> server.stop()  # doctest: +SKIP
    """

    def __init__(self, app: FastAPI, *, host: str = "127.0.0.1", port: int | None = None,
                 log_level: str = "warning", shutdown_timeout: float = 5.0) -> None:
        import uvicorn

        self.host = host
        self.port = port if port is not None else free_port(host)
        self.server = uvicorn.Server(_config(app, host=host, port=self.port,
                                             log_level=log_level,
                                             shutdown_timeout=shutdown_timeout))
        self._thread = threading.Thread(target=self.server.run, name="pagedcore-http",
                                        daemon=True)

    @property
    def url(self) -> str:
        """The base URL (``http://host:port``)."""
        return f"http://{self.host}:{self.port}"

    def start(self, *, timeout: float = 60.0) -> ServerThread:
        """Start serving; return once the server accepts connections."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.02)
        return self

    def stop(self, *, timeout: float = 60.0) -> None:
        """Shut down gracefully and wait for the thread."""
        self.server.should_exit = True
        self._thread.join(timeout)
