"""Many concurrent streams with disconnecting clients; admission control under a full queue."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
from serve_helpers import DEMO_KW, LiveServer

from pagedcore.engine.llm import LLM
from pagedcore.engine.sampling.sampling_params import SamplingParams

N_CLIENTS = 200
MAX_TOKENS = 6


def _prompts(n: int) -> list[str]:
    return [f"Request {i}: tell me about block {i % 17}" for i in range(n)]


async def _stream(client: httpx.AsyncClient, url: str, prompt: str, *,
                  disconnect_after: int | None) -> tuple[int, str | None, str]:
    body: dict[str, Any] = {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS,
                            "temperature": 0, "stream": True}
    if disconnect_after is not None:
        body.update(max_tokens=200, ignore_eos=True)
    text, reason, events = "", None, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return resp.status_code, None, resp.text
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            reason = choice["finish_reason"] or reason
            events += 1
            if disconnect_after is not None and events >= disconnect_after:
                break  # leaving the block closes the connection mid-stream
    return 200, reason, text


def _wait_idle(server: LiveServer, timeout: float = 30.0) -> None:
    """Wait until the engine thread has processed every finish and abort (the engine state is
    read from this thread only to poll)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (server.engine.num_in_flight == 0 and not server.llm.has_unfinished_requests()
                and server.engine.stats()["running"] == 0):
            time.sleep(0.1)  # the engine thread may still be inside its last call
            return
        time.sleep(0.05)
    raise AssertionError(f"still in flight: {server.engine.num_in_flight}")


def test_200_streams_with_20_percent_disconnecting(demo_server: LiveServer) -> None:
    prompts = _prompts(N_CLIENTS)
    ref_llm = LLM("demo", device="cpu", **DEMO_KW)
    refs = ref_llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    # Those who leave ask for many tokens, so they are surely mid-stream when they go.
    leaving = set(range(0, N_CLIENTS, 5))

    async def run() -> list[Any]:
        limits = httpx.Limits(max_connections=N_CLIENTS + 10)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            tasks = [_stream(client, demo_server.url, p,
                             disconnect_after=2 if i in leaving else None)
                     for i, p in enumerate(prompts)]
            return list(await asyncio.gather(*tasks))

    results = asyncio.run(run())
    for i, (status, reason, text) in enumerate(results):
        assert status == 200, text
        if i not in leaving:
            assert text == refs[i].outputs[0].text, i
            assert reason == refs[i].outputs[0].finish_reason
    _wait_idle(demo_server)
    metrics = httpx.get(demo_server.url + "/metrics").text
    aborted = [line for line in metrics.splitlines()
               if line.startswith('pagedcore:request_success_total{finished_reason="abort"')]
    # (A client that leaves may already have been sent all its tokens: count only some.)
    assert aborted and float(aborted[0].split()[-1]) >= 1, metrics
    kv = demo_server.llm.kv_cache_manager
    assert kv.usage == 0.0 and kv.num_free_blocks == kv.num_total_blocks
    assert not demo_server.llm.has_unfinished_requests()


def _count(server: LiveServer, reason: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(f'pagedcore:request_success_total{{finished_reason="{reason}"'):
            return float(line.split()[-1])
    return 0.0


def test_disconnect_aborts_a_long_request_at_once(demo_server: LiveServer) -> None:
    aborted, finished = _count(demo_server, "abort"), _count(demo_server, "length")

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"model": "m", "prompt": "long", "max_tokens": 240, "ignore_eos": True,
                    "stream": True}
            async with client.stream("POST", demo_server.url + "/v1/completions",
                                     json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        break
                assert demo_server.engine.num_in_flight == 1

    asyncio.run(run())
    _wait_idle(demo_server, timeout=5.0)
    assert demo_server.llm.kv_cache_manager.usage == 0.0
    assert (_count(demo_server, "abort"), _count(demo_server, "length")) == (aborted + 1,
                                                                             finished)


def test_queue_full_answers_503_and_loses_nothing() -> None:
    server = LiveServer("demo", max_waiting=2, max_model_len=256, max_num_seqs=2)
    try:
        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as client:
                body = {"model": "m", "prompt": "queue", "max_tokens": 64,
                        "ignore_eos": True, "temperature": 0}
                return list(await asyncio.gather(*(
                    client.post(server.url + "/v1/completions", json=body)
                    for _ in range(12))))

        responses = asyncio.run(run())
        ok = [r for r in responses if r.status_code == 200]
        refused = [r for r in responses if r.status_code == 503]
        assert len(ok) + len(refused) == len(responses)
        assert 4 <= len(ok) < len(responses)  # capacity = max_num_seqs + max_waiting = 4
        for r in refused:
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_full"
        texts = {r.json()["choices"][0]["text"] for r in ok}
        assert len(texts) == 1  # every admitted request completed, with the same greedy text
        assert all(r.json()["usage"]["completion_tokens"] == 64 for r in ok)
        metrics = httpx.get(server.url + "/metrics").text
        assert f'pagedcore:request_refused_total{{model_name="m"}} {len(refused)}.0' in metrics
    finally:
        server.stop()


def test_non_streaming_client_that_leaves_is_aborted(
    demo_server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    aborted = _count(demo_server, "abort")
    # Slow each engine step down so the 240 tokens cannot finish before the client leaves
    # (the demo model alone can run them in ~0.3 s on an idle machine: a race otherwise).
    llm = demo_server.llm
    real_step = llm.step

    def slow_step(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.01)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(llm, "step", slow_step)

    async def run() -> None:
        async with httpx.AsyncClient(timeout=0.3) as client:
            body = {"model": "m", "prompt": "leave", "max_tokens": 240, "ignore_eos": True}
            try:
                await client.post(demo_server.url + "/v1/completions", json=body)
            except httpx.TimeoutException:
                pass  # the client gives up and closes the connection

    asyncio.run(run())
    _wait_idle(demo_server, timeout=5.0)
    assert _count(demo_server, "abort") == aborted + 1
    assert demo_server.llm.kv_cache_manager.usage == 0.0


def test_admitted_but_never_started_gives_its_slots_back(demo_server: LiveServer) -> None:
    from pagedcore.serve.serving import FanIn

    engine = demo_server.engine
    before = engine.num_in_flight
    fan = FanIn(engine, [])
    fan._unstarted = 3  # as if three sequences were admitted
    engine.reserve(3)
    assert engine.num_in_flight == before + 3
    del fan
    assert engine.num_in_flight == before
