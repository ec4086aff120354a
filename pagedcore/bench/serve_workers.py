"""`pagedcore bench serve --num-workers K`: the load split over K client processes.

One Python client parses every server-sent event of every stream; against a fast server that
is the bottleneck (tens of microseconds of CPU per event: a few tens of thousands of tokens
per second, about what one H200 generates with a small model). K processes split the work
round-robin, each at 1/K of the rate (K Poisson processes of rate r/K add up to one of rate
r; fixed-rate workers are staggered by 1/r), and start together at a barrier. Their
per-request results are merged; the duration runs from the first worker's start to the last
one's end (``time.perf_counter`` is the system-wide monotonic clock on Linux and macOS, so
the workers' clocks agree).
"""

from __future__ import annotations

import asyncio
import math
import queue
import time
from collections.abc import Sequence
from typing import Any

from pagedcore.bench.serve_load import RequestResult, WorkItem, run_load

__all__ = ["run_load_workers"]


def _worker(index: int, work: Sequence[WorkItem], kwargs: dict[str, Any], delay: float,
            barrier: Any, out: Any) -> None:
    try:
        barrier.wait(timeout=120)
        t0 = time.perf_counter()
        if delay:
            time.sleep(delay)
        results, _ = asyncio.run(run_load(work, **kwargs))
        out.put((index, results, t0, time.perf_counter(), None))
    except BaseException as exc:  # reported by the parent
        out.put((index, [], 0.0, 0.0, f"{type(exc).__name__}: {exc}"))


def run_load_workers(
    work: Sequence[WorkItem],
    *,
    num_workers: int,
    request_rate: float = math.inf,
    arrival: str = "poisson",
    max_concurrency: int | None = None,
    seed: int = 0,
    **kwargs: Any,
) -> tuple[list[RequestResult], float]:
    """`run_load` spread over `num_workers` processes: the results (in `work`'s order) and
    the wall time (s). `kwargs` go to `run_load` as they are.

    Raises
    ------
    RuntimeError
        A worker failed (its error is in the message).
    """
    import multiprocessing

    k = max(1, min(num_workers, len(work)))
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(k)
    out = ctx.Queue()
    rate = request_rate / k
    cap = None if max_concurrency is None else max(1, math.ceil(max_concurrency / k))
    procs = []
    for i in range(k):
        delay = i / request_rate if arrival == "fixed" and math.isfinite(request_rate) else 0.0
        kw = dict(kwargs, request_rate=rate, arrival=arrival, max_concurrency=cap,
                  seed=seed + 7919 * i)
        p = ctx.Process(target=_worker, args=(i, list(work[i::k]), kw, delay, barrier, out),
                        name=f"bench-serve-{i}", daemon=True)
        p.start()
        procs.append(p)
    parts: dict[int, tuple[list[RequestResult], float, float]] = {}
    errors: list[str] = []
    while len(parts) + len(errors) < k:
        try:
            index, results, t0, t1, error = out.get(timeout=1.0)
        except queue.Empty:
            if not any(p.is_alive() for p in procs):
                errors.append("a worker exited without reporting")
                break
            continue
        if error is not None:
            errors.append(f"worker {index}: {error}")
        else:
            parts[index] = (results, t0, t1)
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
    if errors:
        raise RuntimeError("bench serve workers failed: " + "; ".join(errors))
    merged: list[RequestResult | None] = [None] * len(work)
    for i, (results, _, _) in parts.items():
        for j, result in enumerate(results):
            merged[i + j * k] = result
    start = min(t0 for _, t0, _ in parts.values())
    end = max(t1 for _, _, t1 in parts.values())
    return [r if r is not None else RequestResult(error="lost") for r in merged], end - start
