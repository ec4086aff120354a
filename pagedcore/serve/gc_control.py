"""Python's garbage collector in a server's two processes: the startup heap frozen, pauses traced.

A full (generation 2) collection walks every tracked object. After startup the engine process
holds hundreds of thousands of them that live for the whole run (the model's modules, torch's
and transformers' objects, the tokenizer), and each full collection during serving would walk
them again while the GPU waits for its next step. `freeze_startup_heap` moves what exists
after startup into the collector's permanent generation (`gc.freeze`, as vLLM and SGLang do
after their engines start), so collections during serving walk only what serving created.
With ``PAGEDCORE_STEP_TRACE`` set, `watch_gc` writes each collection of the older generations
into the trace (``{"ev": "gc", "t", "s", "gen", "proc"}``) next to the steps it delays.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

__all__ = ["freeze_startup_heap", "watch_gc"]


def freeze_startup_heap() -> int:
    """Collect once, then freeze every object that is left (they are never collected again,
    nor walked by later collections); the number of objects frozen."""
    gc.collect()
    gc.freeze()
    return int(gc.get_freeze_count())


def watch_gc(write: Callable[[dict[str, Any]], None], proc: str, *,
             min_generation: int = 1) -> Callable[[], None]:
    """Report every collection of generation `min_generation` or older to `write` as a
    ``{"ev": "gc", "t": start, "s": seconds, "gen": g, "proc": proc}`` row (``t`` on
    ``time.perf_counter``); the function that stops reporting."""
    started = [0.0]
    clock = time.perf_counter

    def callback(phase: str, info: dict[str, Any]) -> None:
        generation = int(info["generation"])
        if generation < min_generation:
            return
        if phase == "start":
            started[0] = clock()
        else:
            write({"ev": "gc", "t": started[0], "s": clock() - started[0], "gen": generation,
                   "proc": proc})

    gc.callbacks.append(callback)

    def stop() -> None:
        if callback in gc.callbacks:
            gc.callbacks.remove(callback)

    return stop
