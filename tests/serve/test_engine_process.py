"""The engine in its own process (`AsyncEngine.spawn`, `pagedcore serve`'s default), and the
merging of deltas for a consumer that fell behind."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from serve_helpers import DEMO_KW

from pagedcore.engine.engine_args import EngineArgs
from pagedcore.engine.llm import LLM
from pagedcore.engine.sampling.sampling_params import SamplingParams
from pagedcore.serve.app import build_app
from pagedcore.serve.async_engine import AsyncEngine
from pagedcore.serve.metrics import ServeMetrics
from pagedcore.serve.server import ServerThread

PROMPTS = [f"Request {i}: the block table of {i % 5}" for i in range(24)]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def process_server() -> Iterator[tuple[ServerThread, AsyncEngine]]:
    engine = AsyncEngine.spawn(EngineArgs(model="demo", device="cpu", **DEMO_KW), threads=1,
                               stream_interval=2)
    metrics = ServeMetrics("m", engine.stats)
    engine.metrics = metrics
    server = ServerThread(build_app(engine, model_names=["m"], metrics=metrics)).start()
    yield server, engine
    server.stop()
    assert not engine._process.alive  # type: ignore[union-attr]


async def _stream(client: httpx.AsyncClient, url: str, prompt: str, *,
                  disconnect: bool = False) -> tuple[str, int]:
    body: dict[str, Any] = {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS,
                            "temperature": 0, "stream": True, "ignore_eos": True}
    if disconnect:
        body["max_tokens"] = 200
    text, events = "", 0
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            text += event["choices"][0]["text"]
            events += 1
            if disconnect and events >= 2:
                break  # leaving the block closes the connection mid-stream
    return text, events


def _wait_idle(engine: AsyncEngine, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.stats()
        if engine.num_in_flight == 0 and stats["running"] == 0 \
                and stats["kv_cache_usage"] == 0.0:
            return stats
        time.sleep(0.05)
    raise AssertionError(f"not idle: {engine.num_in_flight} in flight, {engine.stats()}")


def test_process_streams_equal_generate_and_disconnects_free_blocks(
        process_server: tuple[ServerThread, AsyncEngine]) -> None:
    server, engine = process_server
    # The engine process froze its startup heap (the model's objects) before serving.
    assert engine.info.frozen_objects > 10_000
    ref_llm = LLM("demo", device="cpu", **DEMO_KW)
    refs = ref_llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                    ignore_eos=True))

    async def main() -> list[tuple[str, int]]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(
                _stream(client, server.url, p, disconnect=i % 4 == 3)
                for i, p in enumerate(PROMPTS)))

    results = asyncio.run(main())
    for i, ((text, events), ref) in enumerate(zip(results, refs, strict=True)):
        if i % 4 == 3:
            continue
        assert text == ref.outputs[0].text
        # --stream-interval 2: a chunk carries up to two tokens (one per token at interval 1)
        assert events <= MAX_TOKENS // 2 + 2
    stats = _wait_idle(engine)  # the disconnected ones were aborted, every block is free
    assert stats["steps"] > 0
    # prompt_logprobs cross the pipe too (Logprob objects), in one chunk of the stream.
    ids = ref_llm.tokenizer.encode(PROMPTS[0])
    want = ref_llm.generate([PROMPTS[0]], SamplingParams(
        max_tokens=2, temperature=0, prompt_logprobs=1))[0].prompt_logprobs
    body = {"model": "m", "prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0,
            "stream": True, "prompt_logprobs": 1}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as resp:
        carried = [json.loads(line[6:])["choices"][0].get("prompt_logprobs")
                   for line in resp.iter_lines()
                   if line.startswith("data: {") and '"choices":[{' in line]
    [got] = [c for c in carried if c is not None]
    assert want is not None and len(got) == len(ids) and got[0] is None
    assert [sorted(int(t) for t in g) for g in got[1:]] == [sorted(w) for w in want[1:]]
    metrics = httpx.get(server.url + "/metrics").text
    assert 'pagedcore:request_success_total{finished_reason="abort",model_name="m"} 6.0' \
        in metrics


def test_process_full_pipes_do_not_deadlock(
        process_server: tuple[ServerThread, AsyncEngine]) -> None:
    """More commands at once than the command pipe holds, while the engine streams more than
    the output pipe holds: the front end must never block on a pipe (it once did)."""
    server, engine = process_server
    prompts = [[3 + (i * 7 + j) % 200 for j in range(200)] for i in range(150)]

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> int:
        resp = await client.post(server.url + "/v1/completions", json={
            "model": "m", "prompt": prompt, "max_tokens": 6, "ignore_eos": True})
        assert resp.status_code == 200, resp.text
        return int(resp.json()["usage"]["completion_tokens"])

    async def main() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.wait_for(
                asyncio.gather(*(one(client, p) for p in prompts)), timeout=60)

    assert asyncio.run(main()) == [6] * len(prompts)
    _wait_idle(engine)


def test_process_engine_death_fails_requests(
        process_server: tuple[ServerThread, AsyncEngine]) -> None:
    """Last in this module: the engine process dies mid-stream."""
    server, engine = process_server

    async def main() -> str:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"model": "m", "prompt": "hello", "max_tokens": 200, "ignore_eos": True,
                    "stream": True}
            async with client.stream("POST", server.url + "/v1/completions",
                                     json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: ") and engine._process is not None \
                            and engine._process.alive:
                        engine._process.process.kill()
                    if '"error"' in line:
                        return line
        return ""

    line = asyncio.run(main())
    assert "engine_dead" in line and "exited" in line
    health = httpx.get(server.url + "/health")
    assert health.status_code == 503 and "exited" in health.json()["reason"]
    refused = httpx.post(server.url + "/v1/completions",
                         json={"model": "m", "prompt": "hi", "max_tokens": 2})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"


def test_slow_consumer_gets_merged_deltas() -> None:
    """A consumer behind the engine gets what waits merged into one delta, nothing lost."""
    llm = LLM("demo", device="cpu", **DEMO_KW)
    ref = llm.generate(["merge me"], SamplingParams(max_tokens=24, temperature=0,
                                                   ignore_eos=True))[0].outputs[0]
    engine = AsyncEngine(llm)
    engine.start()

    async def main() -> list[Any]:
        deltas = []
        async for delta in engine.generate(list(ref_prompt), SamplingParams(
                max_tokens=24, temperature=0, ignore_eos=True)):
            deltas.append(delta)
            await asyncio.sleep(0.05)  # slower than a step of this tiny model
        return deltas

    ref_prompt = llm.tokenizer.encode("merge me")
    try:
        deltas = asyncio.run(main())
    finally:
        engine.close()
    assert [t for d in deltas for t in d.token_ids] == ref.token_ids
    assert "".join(d.text for d in deltas) == ref.text
    assert len(deltas) < len(ref.token_ids) // 2
    assert deltas[-1].finish_reason == "length" and deltas[-1].num_generated_tokens == 24


def test_engine_process_send_never_blocks() -> None:
    """A busy front end (its loop not reading) while the engine fills its output pipe: sending
    more commands than the command pipe holds must still return at once (buffered), or both
    sides block on a full pipe for good."""
    import threading

    from pagedcore.serve.engine_process import EngineProcess

    proc = EngineProcess(EngineArgs(model="demo", device="cpu", **DEMO_KW), threads=1)
    loop = asyncio.new_event_loop()
    messages: list[Any] = []
    proc.attach(loop, messages.append)  # attached, but the loop does not run
    prompt = [3 + j % 200 for j in range(200)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)

    def send_all() -> None:
        for i in range(100):
            proc.send(("add", f"r{i}", prompt, params))
        time.sleep(2.0)  # the engine steps them and fills its output pipe, then blocks on it
        for i in range(100, 400):
            proc.send(("add", f"r{i}", prompt, params))

    sender = threading.Thread(target=send_all, daemon=True)
    try:
        sender.start()
        sender.join(15)
        assert not sender.is_alive(), "EngineProcess.send blocked on a full pipe"
    finally:
        proc.close(timeout=30)
        loop.close()
    assert not proc.alive
