"""The client core of `pagedcore bench serve`: one request's stream, and a load of them.

`run_load` sends a workload from one asyncio loop (`pagedcore.bench.serve_workers` splits it
over processes); `WorkItem` is one request of the workload, `RequestResult` what the client saw
of it.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Sequence
from typing import Any

import attrs

__all__ = ["RequestResult", "WorkItem", "run_load"]


@attrs.frozen
class WorkItem:
    """One request of the workload: its prompt and how many tokens to generate."""

    prompt: str | list[int]
    prompt_len: int
    output_len: int


@attrs.define
class RequestResult:
    """What the client saw of one request (seconds, ``time.perf_counter``)."""

    ok: bool = False
    error: str | None = None
    start: float = 0.0
    ttft: float | None = None
    itl: list[float] = attrs.Factory(list)
    e2e: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0



def _body(item: WorkItem, *, model: str, endpoint: str, ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": item.output_len, "stream": True,
                            "stream_options": {"include_usage": True}, "temperature": 0.0}
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM's and pagedcore's extension: exact output lengths
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": item.prompt}]
    else:
        body["prompt"] = item.prompt
    return body


async def _one(session: Any, url: str, body: bytes, headers: dict[str, str],
               result: RequestResult) -> None:
    result.start = time.perf_counter()
    last = result.start
    chunks = 0
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            if resp.status != 200:
                text = (await resp.read()).decode(errors="replace")
                result.error = f"HTTP {resp.status}: {text[:200]}"
                return
            async for raw in resp.content:  # one server-sent-events line at a time
                if not raw.startswith(b"data:"):
                    continue
                data = raw[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = str(event["error"].get("message"))
                    return
                if event.get("usage"):
                    result.output_tokens = int(event["usage"]["completion_tokens"])
                    result.prompt_tokens = int(event["usage"]["prompt_tokens"])
                if not event.get("choices"):
                    continue
                choice = event["choices"][0]
                if ("delta" in choice and not choice["delta"].get("content")
                        and choice.get("finish_reason") is None):
                    continue  # a chat chunk without content (the role)
                now = time.perf_counter()
                if result.ttft is None:
                    result.ttft = now - result.start
                else:
                    result.itl.append(now - last)
                last = now
                chunks += 1
        result.e2e = time.perf_counter() - result.start
        if result.output_tokens == 0:
            result.output_tokens = chunks
        result.ok = True
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"


async def run_load(
    work: Sequence[WorkItem],
    *,
    base_url: str,
    model: str,
    endpoint: str = "completions",
    request_rate: float = math.inf,
    arrival: str = "poisson",
    max_concurrency: int | None = None,
    ignore_eos: bool = True,
    api_key: str | None = None,
    timeout: float = 600.0,
    seed: int = 0,
    progress: Any = None,
) -> tuple[list[RequestResult], float]:
    """Send `work` against the server; the per-request results and the wall time (s).

    The client is aiohttp (as vLLM's benchmark client): it had 250 simultaneous streams'
    bodies on the wire in 0.05 s where httpx took ~0.3 s (docs/serving.md), time a rate-inf
    run would charge to the server. Bodies are encoded before the clock starts."""
    import aiohttp

    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    url = base_url.rstrip("/") + path
    headers = {"content-type": "application/json"}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    rng = random.Random(seed + 1)
    cap = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results = [RequestResult() for _ in work]
    bodies = [json.dumps(_body(item, model=model, endpoint=endpoint,
                               ignore_eos=ignore_eos)).encode() for item in work]
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0)  # 0: no cap
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=timeout)) as session:

        async def send(body: bytes, result: RequestResult) -> None:
            if cap is None:
                await _one(session, url, body, headers, result)
            else:
                async with cap:
                    await _one(session, url, body, headers, result)
            if progress is not None:
                progress()

        start = time.perf_counter()
        tasks = []
        for body, result in zip(bodies, results, strict=True):
            tasks.append(asyncio.ensure_future(send(body, result)))
            if math.isfinite(request_rate):
                gap = rng.expovariate(request_rate) if arrival == "poisson" else 1 / request_rate
                await asyncio.sleep(gap)
        await asyncio.gather(*tasks)
        return results, time.perf_counter() - start
