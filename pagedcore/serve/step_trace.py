"""The engine loop's timeline, for finding where a server run's time goes.

With ``PAGEDCORE_STEP_TRACE=<path>`` in the environment of ``pagedcore serve`` the engine loop
(`CoreLoop`, in the engine process or thread) appends one JSON line per event to `path`:

- ``{"ev": "wait", "t": ..., "s": ...}``: the loop blocked ``s`` seconds for a command (idle);
- ``{"ev": "cmd", "t": ..., "add": n, "other": m}``: it handled commands (``add`` requests);
- ``{"ev": "step", "t": ..., "step_s": ..., "emit_s": ..., "items": ..., "running": ...,
  "waiting": ..., "tokens": ...}``: one `LLM.step` (``step_s``), then the hand-over of its
  ``items`` to the front end (``emit_s``: building them, pickling and writing the frame),
  with the scheduler's running / waiting counts and the step's scheduled tokens;
- ``{"ev": "gc", "t": ..., "s": ..., "gen": g, "proc": ...}``: a garbage collection of
  generation 1 or 2 (`pagedcore.serve.gc_control.watch_gc`) in the engine's process
  (``"engine"``, or ``"server"`` when the engine runs on a thread of the server), or in the
  server's process (``"front"``, in the file ``<path>.front``: two processes never append to
  one file).

``t`` is ``time.perf_counter()`` at the event's start: on Linux the system-wide monotonic
clock, the same as the clock of `pagedcore bench serve`'s per-request times, so a run's
client timestamps (its summary's ``clock``) and the engine's line up. `read` merges the two
files; `summarize` folds a trace between two such times into seconds per phase. Off (no
file, no cost) unless the variable is set.
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

    def __init__(self, path: str, *, proc: str = "engine", line_buffered: bool = False) -> None:
        #: Which process writes it (the ``proc`` of its ``gc`` rows).
        self.proc = proc
        self._file: IO[str] = open(path, "a", encoding="utf-8",
                                   buffering=1 if line_buffered else 1 << 16)

    @classmethod
    def from_env(cls, *, proc: str = "engine", suffix: str = "",
                 line_buffered: bool = False) -> StepTrace | None:
        """A trace to the file `STEP_TRACE_ENV` names (plus `suffix`), or None when the
        variable is unset or empty."""
        path = os.environ.get(STEP_TRACE_ENV, "").strip()
        return cls(path + suffix, proc=proc, line_buffered=line_buffered) if path else None

    @staticmethod
    def check_env() -> None:
        """ValueError naming `STEP_TRACE_ENV` and its path when the trace file it names
        cannot be opened for appending (checked before the server starts: the engine loop
        opens it later, where a failure would only stop the loop)."""
        path = os.environ.get(STEP_TRACE_ENV, "").strip()
        if not path:
            return
        try:
            with open(path, "a", encoding="utf-8"):
                pass
        except OSError as exc:
            raise ValueError(f"{STEP_TRACE_ENV}={path!r}: cannot write the step trace there "
                             f"({exc.strerror or exc}); name a writable file or unset it") \
                from exc

    def row(self, row: dict[str, Any]) -> None:
        """Append one event (a JSON object with ``ev`` and ``t``)."""
        self._file.write(json.dumps(row, separators=(",", ":")) + "\n")


    def wait(self, t: float, seconds: float) -> None:
        """The loop blocked `seconds` from `t` waiting for a command."""
        self.row({"ev": "wait", "t": t, "s": seconds})

    def flush(self) -> None:
        """Write out what is buffered (the loop calls it before it blocks: idle, and a
        reader then sees every step so far)."""
        self._file.flush()

    def commands(self, t: float, adds: int, others: int) -> None:
        """It handled `adds` new requests and `others` other commands from `t`."""
        self.row({"ev": "cmd", "t": t, "add": adds, "other": others})

    def step(self, t: float, step_s: float, emit_s: float, *, items: int, running: int,
             waiting: int, tokens: int) -> None:
        """One step from `t`: `step_s` in `LLM.step`, `emit_s` handing its items over."""
        self.row({"ev": "step", "t": t, "step_s": step_s, "emit_s": emit_s, "items": items,
                     "running": running, "waiting": waiting, "tokens": tokens})

    def close(self) -> None:
        """Flush and close the file."""
        self._file.close()


def summarize(rows: Iterable[dict[str, Any]], start: float | None = None,
              end: float | None = None) -> dict[str, Any]:
    """Seconds per phase of the events that start in ``[start, end]`` (all when None).

    Returns ``first_add`` / ``last_step_end`` (clock times), ``span_s`` (from the first add to
    the last step's end), ``step_s``, ``emit_s``, ``wait_s`` (idle, up to `end`), ``commands``
    (adds handled), ``steps``, ``other_s``: the span less steps, emits and waits (the loop's
    own work: receiving and handling commands, stats snapshots), and ``gc``: per process,
    the collections (``n``), their seconds (``s``) and the longest (``max_s``).
    """
    lo = -float("inf") if start is None else start
    hi = float("inf") if end is None else end
    out: dict[str, Any] = {"steps": 0, "step_s": 0.0, "emit_s": 0.0, "wait_s": 0.0,
                           "commands": 0, "first_add": None, "last_step_end": None,
                           "gc": {}}
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
            out["wait_s"] += min(row["s"], hi - t)  # the idle after the window is not its
        elif ev == "gc":
            gc = out["gc"].setdefault(row.get("proc", "?"), {"n": 0, "s": 0.0, "max_s": 0.0})
            gc["n"] += 1
            gc["s"] += row["s"]
            gc["max_s"] = max(gc["max_s"], row["s"])
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
    """The rows of the trace file at `path` and of its ``.front`` companion (when the server's
    process wrote one), in time order."""
    rows: list[dict[str, Any]] = []
    for name in (path, path + ".front"):
        if name == path or os.path.exists(name):
            with open(name, encoding="utf-8") as f:
                rows += [json.loads(line) for line in f if line.strip()]
    rows.sort(key=lambda row: row["t"])
    return rows
