"""Rank 0's hold on its workers: `WorkerPool` (processes, pipes, groups; closing it stops them)
and `WorkerMonitor`.

Rank 0's watch over its workers while the engine runs.

A collective rank 0 is blocked in cannot notice by itself that the other side died: on NCCL it
spins on the GPU (inside a replayed CUDA graph NCCL's own timeout does not even apply), and
aborting the communicator does not help while a graph holds it. `WorkerMonitor` waits on the
worker processes' sentinels from a daemon thread and records which one exited; rank 0 waits
for each step by polling the step's CUDA event and this flag (`TensorParallelExecutor.execute`),
so the step ends with `TensorParallelError` instead of hanging. On gloo the dead process's
sockets close and the collective fails by itself.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import multiprocessing.process
    from multiprocessing.connection import Connection

    from pagedcore.engine.distributed.group import Groups
    from pagedcore.engine.runner.model_runner import ModelRunner

__all__ = ["WorkerMonitor", "WorkerPool"]


class WorkerMonitor:
    """Wait, in a daemon thread, for any of `procs` to exit; then record its rank in
    `dead_rank`. `stop` ends the watch (before a graceful shutdown, whose workers exit on
    purpose)."""

    def __init__(self, procs: Mapping[int, multiprocessing.process.BaseProcess]) -> None:
        self.dead_rank: int | None = None
        self._ranks = {proc.sentinel: rank for rank, proc in procs.items()}
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

    def stop(self) -> None:
        """End the watch (idempotent); a worker exiting afterwards is not reported."""
        if not self._stop_write.closed:
            self._stop_write.send(None)
            self._stop_write.close()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)


class WorkerPool:
    """Rank 0's worker processes, their pipes, the rendezvous store, the process groups, the
    monitor and the attached runner; closing it stops the workers and leaves the groups (also
    at exit)."""

    def __init__(self) -> None:
        self.procs: dict[int, multiprocessing.process.BaseProcess] = {}
        self.conns: dict[int, Connection] = {}
        #: Rank 0's rendezvous store (a `TCPStore` server), held here only: dropped on close,
        #: which closes it and fails every wait on it (rank 0 joins the groups over a client
        #: connection of its own, which the default process group keeps).
        self.store: Any = None
        self.groups: Groups | None = None
        self.monitor: WorkerMonitor | None = None
        #: Rank 0's runner, once attached (its CUDA graphs go before the communicator).
        self.runner: ModelRunner | None = None
        self.closed = False

    def close(self, *, graceful: bool) -> None:
        if self.closed:
            return
        self.closed = True
        import torch.distributed as dist

        if self.monitor is not None:
            self.monitor.stop()

        from pagedcore.engine.distributed.group import destroy_groups

        if graceful and self.groups is not None:
            try:
                dist.broadcast_object_list([None], src=0, group=self.groups.control)
            except RuntimeError:
                graceful = False
        deadline = time.monotonic() + (10.0 if graceful else 0.0)
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns.values():
            conn.close()
        captured = self.runner is not None and (
            self.runner.graphs is not None or self.runner.mixed_graphs is not None
        )
        if self.groups is not None and (graceful or not captured):
            if self.runner is not None:
                self.runner.release_graphs()
            try:
                destroy_groups()
            except RuntimeError:
                pass
        self.store = None
        # After a failure with captured graphs, a replayed all-reduce may still wait for the
        # dead rank, and aborting a communicator a graph holds hangs: leave it. This process
        # keeps its torch.distributed state; a new tensor-parallel LLM needs a new process.
