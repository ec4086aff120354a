"""The engine loop's timeline, for finding where a server run's time goes.

With ``PAGEDCORE_STEP_TRACE=<path>`` in the environment of ``pagedcore serve`` the engine loop
(`CoreLoop`, in the engine process or thread) appends one JSON line per event to `path`:

- ``{"ev": "wait", "t": ..., "s": ...}``: the loop blocked ``s`` seconds for a command (idle);
- ``{"ev": "cmd", "t": ..., "add": n, "other": m}``: it handled commands (``add`` requests);
- ``{"ev": "step", "t": ..., "step_s": ..., "emit_s": ..., "items": ..., "running": ...,
  "waiting": ..., "tokens": ...}``: one `LLM.step` (``step_s``), then the hand-over of its
  ``items`` to the front end (``emit_s``: building them, pickling and writing the frame),
  with the scheduler's running / waiting counts and the step's scheduled tokens.

``t`` is ``time.perf_counter()`` at the event's start: on Linux the system-wide monotonic
clock, the same as the clock of `pagedcore bench serve`'s per-request times, so a run's
client timestamps (its summary's ``clock``) and the engine's line up. `summarize` folds a trace
between two such times into seconds per phase. Off (no file, no cost) unless the variable is
set.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import IO, Any

__all__ = ["STEP_TRACE_ENV", "StepTrace", "read", "summarize"]

#: The environment variable naming the trace file.
STEP_TRACE_ENV = "PAGEDCORE_STEP_TRACE"


class StepTrace:
    """Appends the loop's events to a JSON-lines file (see the module docstring)."""

    def __init__(self, path: str) -> None:
        self._file: IO[str] = open(path, "a", encoding="utf-8", buffering=1 << 16)

    @classmethod
    def from_env(cls) -> StepTrace | None:
        """A trace to the file `STEP_TRACE_ENV` names, or None when it is unset or empty."""
        path = os.environ.get(STEP_TRACE_ENV, "").strip()
        return cls(path) if path else None

    def _write(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(row, separators=(",", ":")) + "\n")

    def wait(self, t: float, seconds: float) -> None:
        """The loop blocked `seconds` from `t` waiting for a command."""
        self._write({"ev": "wait", "t": t, "s": seconds})

    def flush(self) -> None:
        """Write out what is buffered (the loop calls it before it blocks: idle, and a
        reader then sees every step so far)."""
        self._file.flush()

    def commands(self, t: float, adds: int, others: int) -> None:
        """It handled `adds` new requests and `others` other commands from `t`."""
        self._write({"ev": "cmd", "t": t, "add": adds, "other": others})

    def step(self, t: float, step_s: float, emit_s: float, *, items: int, running: int,
             waiting: int, tokens: int) -> None:
        """One step from `t`: `step_s` in `LLM.step`, `emit_s` handing its items over."""
        self._write({"ev": "step", "t": t, "step_s": step_s, "emit_s": emit_s, "items": items,
                     "running": running, "waiting": waiting, "tokens": tokens})

    def close(self) -> None:
        """Flush and close the file."""
        self._file.close()


def summarize(rows: Iterable[dict[str, Any]], start: float | None = None,
              end: float | None = None) -> dict[str, Any]:
    """Seconds per phase of the events that start in ``[start, end]`` (all when None).

    Returns ``first_add`` / ``last_step_end`` (clock times), ``span_s`` (from the first add to
    the last step's end), ``step_s``, ``emit_s``, ``wait_s`` (idle), ``commands`` (adds
    handled), ``steps``, and ``other_s``: the span less steps, emits and waits (the loop's own
    work: receiving and handling commands, stats snapshots).
    """
    lo = -float("inf") if start is None else start
    hi = float("inf") if end is None else end
    out: dict[str, Any] = {"steps": 0, "step_s": 0.0, "emit_s": 0.0, "wait_s": 0.0,
                           "commands": 0, "first_add": None, "last_step_end": None}
    for row in rows:
        t = row["t"]
        if not lo <= t <= hi:
            continue
        ev = row["ev"]
        if ev == "step":
            out["steps"] += 1
            out["step_s"] += row["step_s"]
            out["emit_s"] += row["emit_s"]
            stop = t + row["step_s"] + row["emit_s"]
            if out["last_step_end"] is None or stop > out["last_step_end"]:
                out["last_step_end"] = stop
        elif ev == "wait":
            out["wait_s"] += row["s"]
        elif ev == "cmd" and row["add"]:
            out["commands"] += row["add"]
            if out["first_add"] is None or t < out["first_add"]:
                out["first_add"] = t
    if out["first_add"] is not None and out["last_step_end"] is not None:
        span = out["last_step_end"] - out["first_add"]
        out["span_s"] = span
        out["other_s"] = span - out["step_s"] - out["emit_s"] - out["wait_s"]
    else:
        out["span_s"] = out["other_s"] = None
    return out


def read(path: str) -> list[dict[str, Any]]:
    """The rows of the trace file at `path`."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
