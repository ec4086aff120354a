"""A failing engine step fails only its requests (500); a dead engine answers 503."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from serve_helpers import LiveServer

BODY = {"model": "m", "prompt": "hi", "max_tokens": 4, "temperature": 0}


@pytest.fixture()
def server() -> Any:
    s = LiveServer("demo", max_model_len=128)
    yield s
    s.stop()


def test_failed_step_is_a_500_and_the_server_keeps_serving(server: LiveServer) -> None:
    runner = server.llm.runner
    real = runner.execute
    calls = {"n": 0}

    def flaky(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected kernel failure")
        return real(*args, **kwargs)

    runner.execute = flaky  # type: ignore[method-assign]
    failed = httpx.post(server.url + "/v1/completions", json=BODY, timeout=30)
    assert failed.status_code == 500
    assert "injected kernel failure" in failed.json()["error"]["message"]
    ok = httpx.post(server.url + "/v1/completions", json=BODY, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    # Streaming: the failure arrives as an error event, then [DONE].
    calls["n"] = 0
    lines = httpx.post(server.url + "/v1/completions", json={**BODY, "stream": True},
                       timeout=30).text.splitlines()
    events = [line for line in lines if line.startswith("data: ")]
    assert '"error"' in events[-2] and events[-1] == "data: [DONE]"


def test_dead_engine_answers_503(server: LiveServer) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise SystemError("the engine thread cannot go on")

    server.llm.step = broken  # type: ignore[method-assign]
    resp = httpx.post(server.url + "/v1/completions", json=BODY, timeout=30)
    assert resp.status_code == 503
    assert resp.json()["error"]["code"] == "engine_dead"
    deadline = time.monotonic() + 5
    while httpx.get(server.url + "/health").status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    again = httpx.post(server.url + "/v1/completions", json=BODY, timeout=30)
    assert again.status_code == 503 and "cannot go on" in again.json()["error"]["message"]
