"""Where the time of one request's first token goes: a per-phase breakdown of engine steps.

`phase_breakdown` runs requests one at a time through the public online API
(`LLM.add_request` / `LLM.step`) with timing shims around the step's phases, each ended by a
device sync so a phase is charged for the device work it queued:

``add``
    `LLM.add_request` (prompt validation, `Request` construction);
``schedule``
    `Scheduler.schedule` (block hashes, prefix lookup, block allocation);
``prepare``
    `ModelRunner.prepare` (flattening into host buffers and the uploads);
``execute``
    `ModelRunner.execute` (graph replay or eager forward, plus the sampled rows' logits);
``sample``
    `Sampler.sample` (its ``.tolist()`` syncs anyway);
``update``
    `Scheduler.update_from_output`;
``other``
    the rest of `LLM.step` (building the `RequestOutput`, bookkeeping).

The syncs add a few microseconds per phase; the sum is close to, not equal to, the TTFT the
timeline driver measures. The shims are instance attributes, removed afterwards.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

__all__ = ["PHASES", "format_breakdown", "phase_breakdown", "timed_phases"]

#: Phase names in step order (``other`` is the step's remainder).
PHASES = ("add", "schedule", "prepare", "execute", "sample", "update", "other")

_SHIMS = (
    ("scheduler", "schedule", "schedule"),
    ("runner", "prepare", "prepare"),
    ("runner", "execute", "execute"),
    ("sampler", "sample", "sample"),
    ("scheduler", "update_from_output", "update"),
)


@contextmanager
def timed_phases(llm: Any, sync: Callable[[], None] | None,
                 sink: dict[str, float]) -> Iterator[None]:
    """Add each phase's seconds to `sink` while the context is open.

    Parameters
    ----------
    llm:
        A local (not tensor-parallel) `pagedcore.LLM`.
    sync:
        Waits for the device (``torch.cuda.synchronize``), or None on CPU.
    sink:
        Phase name -> accumulated seconds (entries are created as needed).
    """
    def wrap(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        def shim(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            if sync is not None:
                sync()
            sink[name] = sink.get(name, 0.0) + time.perf_counter() - t0
            return out

        return shim

    patched = []
    for owner_name, attr, phase in _SHIMS:
        owner = getattr(llm, owner_name)
        patched.append((owner, attr, owner.__dict__.get(attr)))
        setattr(owner, attr, wrap(getattr(owner, attr), phase))
    try:
        yield
    finally:
        for owner, attr, shadowed in reversed(patched):
            if shadowed is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, shadowed)


def _run_one(llm: Any, rid: str, prompt: list[int], params: Any,
             sync: Callable[[], None] | None) -> dict[str, Any]:
    """One request alone: per-phase seconds summed over its steps, and its step count."""
    if llm.has_unfinished_requests():
        raise ValueError("phase_breakdown needs an idle engine")
    sink: dict[str, float] = {}
    mixed = getattr(llm.runner, "mixed_graphs", None)
    replays_before = 0 if mixed is None else mixed.num_replays
    steps = 0
    cached = None
    with timed_phases(llm, sync, sink):
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        llm.add_request(rid, prompt, params)
        t1 = time.perf_counter()
        sink["add"] = t1 - t0
        while llm.has_unfinished_requests():
            s0 = time.perf_counter()
            outs = llm.step()
            sink["step"] = sink.get("step", 0.0) + time.perf_counter() - s0
            steps += 1
            for out in outs:
                if out.finished:
                    cached = out.num_cached_tokens
    total = time.perf_counter() - t0
    inner = sum(sink.get(p, 0.0) for p in PHASES if p not in ("add", "other"))
    sink["other"] = sink.pop("step", 0.0) - inner
    return {
        "phases_s": {p: sink.get(p, 0.0) for p in PHASES},
        "total_s": total,
        "steps": steps,
        "num_cached_tokens": cached,
        "mixed_graph_replays": None if mixed is None else mixed.num_replays - replays_before,
    }


def phase_breakdown(llm: Any, prompts: Sequence[list[int]], *, label: str,
                    sync: Callable[[], None] | None = None,
                    max_tokens: int = 1) -> dict[str, Any]:
    """Median per-phase milliseconds of `prompts`, each run alone with ``max_tokens``.

    Parameters
    ----------
    llm:
        An idle local `pagedcore.LLM`.
    prompts:
        Token-id prompts, run one after another (ids ``"<label>-<i>"``).
    label:
        Names the rows in the report.
    sync:
        Device sync closing each phase (``torch.cuda.synchronize`` on CUDA).
    max_tokens:
        Tokens per request (1: the steps up to and including the first token only).

    Returns
    -------
    dict
        ``label``, ``n``, ``phases_ms`` (median per phase), ``total_ms`` (median),
        ``steps``, ``num_cached_tokens`` and ``mixed_graph_replays`` (per request).
    """
    from pagedcore.engine.sampling.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    runs = [_run_one(llm, f"{label}-{i}", p, params, sync) for i, p in enumerate(prompts)]
    return {
        "label": label,
        "n": len(runs),
        "max_tokens": max_tokens,
        "phases_ms": {p: statistics.median(r["phases_s"][p] for r in runs) * 1e3
                      for p in PHASES},
        "total_ms": statistics.median(r["total_s"] for r in runs) * 1e3,
        "steps": [r["steps"] for r in runs],
        "num_cached_tokens": [r["num_cached_tokens"] for r in runs],
        "mixed_graph_replays": [r["mixed_graph_replays"] for r in runs],
    }


def format_breakdown(row: dict[str, Any]) -> str:
    """One line: ``label total | phase ms ...``."""
    parts = " ".join(f"{p} {row['phases_ms'][p]:.2f}" for p in PHASES)
    return f"{row['label']}: total {row['total_ms']:.2f} ms | {parts}"


def profile_request(llm: Any, prompt: list[int], path: str, *, label: str) -> dict[str, Any]:
    """Run one request (``max_tokens=1``) under `torch.profiler` and write the operator and
    kernel table (sorted by device time) to `path`.

    Returns
    -------
    dict
        ``wall_ms`` (the request, profiler overhead included), ``device_time_ms`` (self
        device time summed over every event; kernels inside a graph replay included where
        the profiler sees them), ``num_device_events`` and ``path``; or ``error`` when the
        profiler failed (the bench goes on).
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    from pagedcore.engine.sampling.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    activities = [ProfilerActivity.CPU]
    if llm.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    try:
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            llm.add_request(label, prompt, params)
            while llm.has_unfinished_requests():
                llm.step()
            if llm.device.type == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        events = prof.key_averages()
        sort = "self_device_time_total" if llm.device.type == "cuda" else "self_cpu_time_total"
        with open(path, "w") as f:
            f.write(events.table(sort_by=sort, row_limit=40, max_name_column_width=60))
        device_us = [getattr(e, "self_device_time_total", 0.0) for e in events]
        return {"label": label, "wall_ms": wall * 1e3, "device_time_ms": sum(device_us) / 1e3,
                "num_device_events": sum(int(e.count) for e, us in zip(events, device_us,
                                                                        strict=True) if us > 0),
                "path": path}
    except Exception as exc:  # a profiler problem must not cost the figures
        return {"label": label, "error": f"{type(exc).__name__}: {exc}"[:300]}
