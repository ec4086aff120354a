"""Rank 0's watch over its workers while the engine runs.

A collective rank 0 is blocked in cannot notice by itself that the other side died: on NCCL it
spins on the GPU (inside a replayed CUDA graph NCCL's own timeout does not even apply) and the
host waits in a stream synchronisation. `WorkerMonitor` waits on the worker processes'
sentinels from a daemon thread; when one exits while the engine runs it records which, and
calls ``on_death`` (the executor aborts the NCCL communicator there, which makes the pending
collective return), so the step ends with `TensorParallelError` instead of hanging. On gloo the
dead process's sockets close and the collective fails by itself.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import multiprocessing.process

__all__ = ["WorkerMonitor"]


class WorkerMonitor:
    """Wait, in a daemon thread, for any of `procs` to exit; then record its rank in
    `dead_rank` and call ``on_death(rank)`` once. `stop` ends the watch (before a graceful
    shutdown, whose workers exit on purpose)."""

    def __init__(
        self,
        procs: Mapping[int, multiprocessing.process.BaseProcess],
        on_death: Callable[[int], None],
    ) -> None:
        self.dead_rank: int | None = None
        self._ranks = {proc.sentinel: rank for rank, proc in procs.items()}
        self._on_death = on_death
        self._stop_read, self._stop_write = multiprocessing.Pipe(duplex=False)
        self._thread = threading.Thread(target=self._watch, name="pagedcore-tp-monitor",
                                        daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        ready = multiprocessing.connection.wait([*self._ranks, self._stop_read])
        if self._stop_read in ready:
            return
        sentinel = next(s for s in ready if s in self._ranks)
        assert isinstance(sentinel, int)
        self.dead_rank = self._ranks[sentinel]
        self._on_death(self.dead_rank)

    def stop(self) -> None:
        """End the watch (idempotent); a worker exiting afterwards is not reported."""
        if not self._stop_write.closed:
            self._stop_write.send(None)
            self._stop_write.close()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
