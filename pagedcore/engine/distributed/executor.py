"""Rank 0 of a tensor-parallel engine: spawn the workers, broadcast each step's plan, run the
local shard, and turn any rank's failure into one clear error.

`LLM(..., tensor_parallel_size=N)` drives it in this order (every call that involves other
ranks is a collective they mirror, see `pagedcore.engine.distributed.worker`):

1. ``TensorParallelExecutor(model, ...)`` hosts the rendezvous store (a loopback port),
   spawns ranks 1..N-1 (spawn start method), waits until every worker has arrived (or
   reports the one that failed first) and only then joins the process groups, from a helper
   thread while it keeps watching the workers (`_join`); the whole startup shares one
   deadline, `PAGEDCORE_TP_TIMEOUT_S`;
2. `shard` keeps rank 0's share of the loaded model; `rank_config` gives the per-rank config the
   KV-cache specs are built from (``num_kv_heads / N``);
3. `agree_kv_cache_bytes`: the smallest budget of all ranks, so one block count fits all;
4. `attach` sends the KV-cache config (rank 0's scheduler plans for all ranks), gathers what
   each rank built and checks that backends and block counts agree;
5. per step, `prepare` broadcasts the `StepPlan` and `execute` runs the forward; only rank 0
   computes logits.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from pagedcore.engine.distributed.group import (
    TIMEOUT_ENV,
    TensorParallelError,
    emulation_capturer,
)
from pagedcore.engine.distributed.pool import WorkerMonitor, WorkerPool

if TYPE_CHECKING:

    import torch

    from pagedcore.engine.distributed.group import Groups
    from pagedcore.engine.distributed.worker import RankReport
    from pagedcore.engine.runner.input_batch import StepInputs
    from pagedcore.engine.runner.model_runner import ModelRunner
    from pagedcore.engine.scheduling.scheduler_types import ScheduledRequest
    from pagedcore.kv_cache.spec import KVCacheConfig

__all__ = ["TensorParallelError", "TensorParallelExecutor", "peek_config"]

_T = TypeVar("_T")
#: Seconds to wait, after a failed collective, for a worker to report why.
_REPORT_GRACE_S = 3.0
_START_POLL_S = 0.05


def peek_config(model: Any) -> Any:
    """The transformers config `model` will load with, without loading weights."""
    from transformers import PretrainedConfig, PreTrainedModel

    from pagedcore.engine.models.loading import demo_config, random_config

    if isinstance(model, PreTrainedModel):
        raise ValueError(
            "tensor_parallel_size > 1 needs a model every rank can load itself: pass a local "
            "checkpoint directory, 'demo', 'random:<type>' or a transformers config, not a "
            "loaded model"
        )
    if isinstance(model, PretrainedConfig):
        return model
    if model == "demo":
        return demo_config()
    if isinstance(model, str) and model.startswith("random:"):
        return random_config(model.removeprefix("random:"))
    if isinstance(model, str) and os.path.isdir(model):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model, local_files_only=True)
    raise ValueError(f"cannot load model {model!r} (see LLM's `model` parameter)")


class TensorParallelExecutor:
    """Rank 0 of a tensor-parallel engine; stands in for the `ModelRunner` inside `LLM`.

    Parameters
    ----------
    model:
        What `LLM` was given: a checkpoint directory, ``"demo"``, ``"random:<type>"`` or a
        transformers config (every rank loads it; a loaded model cannot be shared).
    tensor_parallel_size:
        Number of ranks N (>= 2); heads, KV heads and the MLP width must divide by N.
    device:
        ``cpu`` (gloo) or ``cuda`` (NCCL; rank r uses ``cuda:r``).
    dtype, seed:
        As for `LLM` (same seed: same random weights on every rank).
    kv_cache_memory_bytes, gpu_memory_utilization:
        Each rank's KV-cache budget, as for `LLM`.
    """

    def __init__(
        self,
        model: Any,
        *,
        tensor_parallel_size: int,
        device: torch.device,
        dtype: torch.dtype,
        seed: int,
        kv_cache_memory_bytes: int | None,
        gpu_memory_utilization: float,
        trust_remote_code: bool = False,
    ) -> None:
        import torch
        import torch.multiprocessing as mp

        from pagedcore.engine.distributed.group import (
            check_uninitialized,
            collective_timeout_s,
            open_store,
            rank_device,
        )
        from pagedcore.engine.distributed.sharding import check_shardable
        from pagedcore.engine.distributed.worker import WorkerArgs, worker_main

        check_shardable(peek_config(model), tensor_parallel_size)
        if tensor_parallel_size < 2:
            raise ValueError("TensorParallelExecutor needs tensor_parallel_size >= 2")
        if device.type == "cuda" and torch.cuda.device_count() < tensor_parallel_size:
            raise ValueError(
                f"tensor_parallel_size={tensor_parallel_size} needs that many GPUs; "
                f"{torch.cuda.device_count()} visible"
            )
        check_uninitialized()
        self.world_size = tensor_parallel_size
        self.device = rank_device(device, 0)
        self.timeout_s = collective_timeout_s()
        # One deadline for the whole startup (hellos, arrivals, joining the groups).
        deadline = time.monotonic() + self.timeout_s
        self.runner: ModelRunner | None = None
        self.rank_reports: list[RankReport] = []
        self._step = 0
        self._dead: str | None = None
        self._pool = WorkerPool()
        self._finalizer = weakref.finalize(self, self._pool.close, graceful=True)
        # Bound before any worker starts; held by the pool only (closing it closes the server).
        self._pool.store = open_store(rank=0, world_size=tensor_parallel_size, port=0,
                                      timeout_s=self.timeout_s)
        port = int(self._pool.store.port)
        ctx = mp.get_context("spawn")
        for rank in range(1, tensor_parallel_size):
            parent, child = ctx.Pipe()
            args = WorkerArgs(
                rank=rank, world_size=tensor_parallel_size, port=port, model=model, dtype=dtype,
                device_type=device.type, seed=seed, num_threads=torch.get_num_threads(),
                timeout_s=self.timeout_s, kv_cache_memory_bytes=kv_cache_memory_bytes,
                gpu_memory_utilization=gpu_memory_utilization,
                trust_remote_code=trust_remote_code,
            )
            proc = ctx.Process(target=worker_main, args=(args, child), daemon=True,
                               name=f"pagedcore-tp-rank{rank}")
            proc.start()
            child.close()
            self._pool.procs[rank] = proc
            self._pool.conns[rank] = parent
        self._wait_for_hellos(deadline)
        self._wait_for_arrivals(deadline)
        self.groups = self._join(deadline, port)
        self._pool.groups = self.groups

        self._pool.monitor = WorkerMonitor(self._pool.procs)

    # ---- setup (collectives mirrored by every worker) ---------------------------------------

    def shard(self, model: Any) -> None:
        """Keep rank 0's share of `model` (in place)."""
        from pagedcore.engine.distributed.sharding import shard_model

        self._guard(lambda: shard_model(model, rank=0, world_size=self.world_size,
                                        all_reduce=self.groups.all_reduce))

    def rank_config(self, config: Any) -> Any:
        """`config` as one rank sees it (heads, KV heads, MLP width divided by N)."""
        from pagedcore.engine.distributed.sharding import rank_config

        return rank_config(config, self.world_size)

    def agree_kv_cache_bytes(self, budget: int) -> int:
        """The smallest KV-cache budget over all ranks."""
        from pagedcore.engine.distributed.group import min_over_ranks

        return self._guard(lambda: min_over_ranks(self.groups, budget, self.device))

    def attach(
        self,
        runner: ModelRunner,
        *,
        kv_cache_config: KVCacheConfig,
        backend: str | None,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        num_heads: int,
        cudagraphs: bool = False,
        cudagraph_capture_sizes: Sequence[int] | None = None,
        kv_cache_dtype: str = "auto",
        kv_scales: dict[int, tuple[float, float]] | None = None,
    ) -> TensorParallelExecutor:
        """Send the KV-cache config to the workers, gather and check what every rank built;
        with `cudagraphs`, every rank then captures the same CUDA graphs (their warm-up
        forwards' all-reduces meet) and rank 0 checks that all ranks captured the same
        buckets."""
        import torch.distributed as dist

        from pagedcore.engine.distributed.worker import WorkerSetup, graph_status, rank_report

        sizes = None if cudagraph_capture_sizes is None else tuple(cudagraph_capture_sizes)
        setup = WorkerSetup(kv_cache_config=kv_cache_config, backend=backend,
                            max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=max_num_batched_tokens,
                            max_model_len=max_model_len, num_heads=num_heads,
                            cudagraphs=cudagraphs, cudagraph_capture_sizes=sizes,
                            kv_cache_dtype=kv_cache_dtype, kv_scales=kv_scales)
        reports: list[Any] = [None] * self.world_size

        def exchange() -> None:
            dist.broadcast_object_list([setup], src=0, group=self.groups.control)
            dist.gather_object(rank_report(0, runner, num_heads), reports, dst=0,
                               group=self.groups.control)

        self._guard(exchange)
        self.rank_reports = list(reports)
        mine = self.rank_reports[0]
        for other in self.rank_reports[1:]:
            if (other.backend_names, other.num_blocks, other.kv_cache_shape,
                    other.kv_cache_dtype) != (
                mine.backend_names, mine.num_blocks, mine.kv_cache_shape, mine.kv_cache_dtype
            ):
                error = TensorParallelError(
                    f"ranks disagree: rank 0 built {mine}, rank {other.rank} built {other}; "
                    "force one backend with backend=... (selection runs on every rank)"
                )
                self._fail(str(error))
                raise error
        if cudagraphs:
            statuses: list[Any] = [None] * self.world_size

            def capture() -> None:
                runner.enable_cudagraphs(sizes=sizes, fallback=False, capturer=emulation_capturer())
                dist.gather_object(graph_status(runner), statuses, dst=0,
                                   group=self.groups.control)

            self._guard(capture)
            if len(set(statuses)) != 1:
                message = (f"ranks captured different CUDA graphs (decode sizes, mixed token "
                           f"buckets per rank: {statuses}); pass enforce_eager=True")
                self._fail(message)
                raise TensorParallelError(message)
        self.runner = runner
        self._pool.runner = runner
        return self

    # ---- the ModelRunner interface ----------------------------------------------------------

    @property
    def backend_names(self) -> list[str]:
        """The chosen backend of each KV-cache group (the same on every rank)."""
        return self._runner.backend_names

    @property
    def local_runner(self) -> ModelRunner:
        """Rank 0's `ModelRunner` (its shard; the same graphs and backends as every rank)."""
        return self._runner

    @property
    def _runner(self) -> ModelRunner:
        if self.runner is None:
            raise RuntimeError("TensorParallelExecutor.attach() has not run")
        return self.runner

    def kv_scale_statuses(self) -> list[dict[str, Any]]:
        """Every rank's `ModelRunner.kv_scale_status()` (fp8 scale source and ranges), rank 0
        first: with an fp8 cache each rank calibrates its own KV heads. Call it between steps
        only (no step in flight: a worker inside a step waits on rank 0's all-reduces)."""
        import torch.distributed as dist

        from pagedcore.engine.distributed.worker import KVScaleQuery

        self._check_alive()
        statuses: list[Any] = [None] * self.world_size

        def ask() -> None:
            dist.broadcast_object_list([KVScaleQuery()], src=0, group=self.groups.control)
            dist.gather_object(self._runner.kv_scale_status(), statuses, dst=0,
                               group=self.groups.control)

        self._guard(ask)
        return statuses

    def prepare(
        self,
        scheduled: Sequence[ScheduledRequest],
        block_ids: Callable[[str], tuple[list[int], ...]],
        *,
        sampled: torch.Tensor | None = None,
    ) -> StepInputs:
        """Prepare rank 0's inputs, then broadcast the step's plan to the workers.

        `sampled` (overlap scheduling): ``[R]`` int64 on rank 0's device, the ids the step in
        flight sampled; broadcast after the plan over the compute group (device to device, no
        host sync), so every rank resolves the plan's placeholders itself.
        """
        import torch.distributed as dist

        from pagedcore.engine.distributed.plan import make_plan
        from pagedcore.engine.runner.prompt_rows import prompt_rows_wanted

        self._check_alive()
        inputs = self._runner.prepare(scheduled, block_ids)
        count = 0 if sampled is None else int(sampled.numel())
        plan = make_plan(self._step, scheduled, block_ids, num_sampled_ids=count,
                         decode_graph=not prompt_rows_wanted(scheduled))
        self._guard(lambda: dist.broadcast_object_list([plan], src=0, group=self.groups.control))
        if sampled is not None and count:
            ids = sampled.contiguous()
            self._guard(lambda: dist.broadcast(ids, src=0, group=self.groups.compute))
        self._step += 1
        return inputs

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Run rank 0's shard of the step; ``[S, V]`` float32 logits (see `ModelRunner`)."""

        runner = self._runner

        def run() -> torch.Tensor:
            logits = runner.execute(inputs)
            if self.device.type == "cuda":
                self._wait_for_step()
            return logits

        return self._guard(run)

    def abort(self, reason: str) -> None:
        """Stop the workers at once (rank 0 failed while they may wait in a collective);
        every later call raises `TensorParallelError` quoting `reason`."""
        if self._dead is None:
            self._fail(reason)

    def _wait_for_step(self) -> None:
        """Wait for the step's GPU work by polling its event, not by a blocking synchronise:
        if a worker dies (the monitor's flag) or the step outlives the collective timeout,
        the all-reduces it left never finish, and the step raises instead of hanging."""
        import torch

        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(torch.cuda.current_stream(self.device))
        start = time.monotonic()
        monitor = self._pool.monitor
        while not done.query():  # type: ignore[no-untyped-call]
            if monitor is not None and monitor.dead_rank is not None:
                raise TensorParallelError(
                    f"tensor-parallel rank {monitor.dead_rank} exited during the step"
                )
            if time.monotonic() - start > self.timeout_s:
                raise TensorParallelError(
                    f"a tensor-parallel step did not finish in {self.timeout_s:g} s (a worker "
                    "hangs?); set PAGEDCORE_TP_TIMEOUT_S to wait longer"
                )
            time.sleep(0)

    def shutdown(self) -> None:
        """Stop the workers and leave the process groups (idempotent; also runs at exit)."""
        if self._dead is None:
            self._dead = "the engine was shut down"
        self._finalizer()

    # ---- failures ---------------------------------------------------------------------------

    def _guard(self, fn: Callable[[], _T]) -> _T:
        """Run `fn` (which may wait on other ranks); on failure stop everything and raise one
        `TensorParallelError` naming the rank that failed."""
        if self._dead is not None:
            raise TensorParallelError(f"the tensor-parallel engine is stopped: {self._dead}")
        try:
            return fn()
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                self._fail(f"interrupted ({type(exc).__name__})")
                raise
            message = self._explain(exc)
            self._fail(message)
            raise TensorParallelError(message) from exc

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise TensorParallelError(f"the tensor-parallel engine is stopped: {self._dead}")
        if any(not p.is_alive() for p in self._pool.procs.values()):
            message = self._explain(None)
            self._fail(message)
            raise TensorParallelError(message)

    def _collect_failures(self, wait_s: float) -> dict[int, str]:
        failures: dict[int, str] = {}
        deadline = time.monotonic() + wait_s
        while True:
            for rank, conn in self._pool.conns.items():
                try:
                    while conn.poll():
                        msg = conn.recv()
                        if msg[0] == "error":
                            failures[rank] = f"{msg[2]}\n--- rank {rank} traceback ---\n{msg[3]}"
                except (EOFError, OSError):
                    pass
                proc = self._pool.procs[rank]
                if rank not in failures and not proc.is_alive():
                    failures[rank] = (
                        f"process exited with code {proc.exitcode} without reporting an error "
                        "(killed, out of memory, or crashed in native code)"
                    )
            if failures or time.monotonic() >= deadline:
                return failures
            time.sleep(_START_POLL_S)

    def _explain(self, exc: BaseException | None) -> str:
        failures = self._collect_failures(_REPORT_GRACE_S if exc is not None else 0.5)
        if failures:
            parts = [f"tensor-parallel rank {r} failed: {text}" for r, text in
                     sorted(failures.items())]
            return "\n".join(parts) + "\nthe engine is stopped; create a new LLM"
        if exc is None:
            return "a tensor-parallel worker stopped without a reason; the engine is stopped"
        return (
            f"tensor-parallel rank 0 failed: {type(exc).__name__}: {exc}\n(no worker reported "
            f"an error; a silent worker makes collectives time out after {self.timeout_s:g} s, "
            "set PAGEDCORE_TP_TIMEOUT_S to change it); the engine is stopped"
        )

    def _fail(self, message: str) -> None:
        self._dead = message
        self._finalizer.detach()
        self._pool.close(graceful=False)

    def _wait_for_hellos(self, deadline: float) -> None:
        """Wait until every worker has imported its libraries (or report the one that died)."""
        waiting = set(self._pool.procs)
        while waiting:
            for rank in sorted(waiting):
                conn = self._pool.conns[rank]
                if conn.poll(_START_POLL_S):
                    msg = conn.recv()
                    if msg[0] == "hello":
                        waiting.discard(rank)
                        continue
                    failures = {rank: f"{msg[2]}\n{msg[3]}"} if msg[0] == "error" else {}
                    self._fail_start(failures)
                if not self._pool.procs[rank].is_alive():
                    self._fail_start(self._collect_failures(0.5))
            if time.monotonic() > deadline:
                self._fail_start({r: f"did not start within {self.timeout_s:g} s (set "
                                     f"{TIMEOUT_ENV} to wait longer)" for r in waiting})

    def _wait_for_arrivals(self, deadline: float) -> None:
        """Wait until every worker has arrived at the rendezvous (`missing_ranks`), watching
        their pipes and processes meanwhile: one that fails or exits first is reported at once.
        Joining the process groups before all arrived would block until the timeout instead,
        with nothing to interrupt it."""
        from pagedcore.engine.distributed.group import missing_ranks

        while missing := missing_ranks(self._pool.store, self.world_size):
            if self._worker_failed():
                self._fail_start(self._collect_failures(0.5))
            if time.monotonic() > deadline:
                self._fail_start({r: f"did not reach the rendezvous within {self.timeout_s:g} s "
                                     f"of the start (set {TIMEOUT_ENV} to wait longer)"
                                  for r in missing})
            time.sleep(_START_POLL_S)

    def _join(self, deadline: float, port: int) -> Groups:
        """Join the process groups (`init_groups`) in a helper thread while watching the
        workers. Joining is a rendezvous no closed socket fails: a worker that dies after its
        arrival mark leaves rank 0 waiting inside ``init_process_group`` or ``new_group``. So
        rank 0 joins over a connection of its own (`connect_store`); when a worker fails,
        `_fail` closes the store's server, which fails the join's waits at once, and the
        thread ends (having left any default group it joined) before the error is raised."""
        import torch

        from pagedcore.engine.distributed.group import connect_store, init_groups

        if self.device.type == "cuda":
            # init_groups sets it in the join's thread; the current device is per thread.
            torch.cuda.set_device(self.device)
        client = connect_store(port=port, world_size=self.world_size, timeout_s=self.timeout_s)
        join_timeout_s = max(deadline - time.monotonic(), 1.0)
        outcome: list[Groups | BaseException] = []

        def join() -> None:
            try:
                outcome.append(init_groups(
                    rank=0, world_size=self.world_size, store=client, device=self.device,
                    timeout_s=self.timeout_s, join_timeout_s=join_timeout_s,
                ))
            except BaseException as exc:  # handed to the constructor's thread
                outcome.append(exc)

        thread = threading.Thread(target=join, name="pagedcore-tp-join", daemon=True)
        thread.start()
        try:
            while thread.is_alive():
                if self._worker_failed():
                    self._fail_start(self._collect_failures(0.5), joining=thread)
                thread.join(_START_POLL_S)
        except (KeyboardInterrupt, SystemExit) as exc:
            self._fail(f"interrupted ({type(exc).__name__})")
            self._end_join(thread)
            raise
        result = outcome[0]
        if isinstance(result, BaseException):
            self._fail_start(self._collect_failures(0.5) or {
                0: f"could not join the process groups: {type(result).__name__}: {result} "
                   f"(startup deadline {self.timeout_s:g} s, {TIMEOUT_ENV})"
            })
        return result

    @staticmethod
    def _end_join(thread: threading.Thread) -> None:
        """Wait for `_join`'s thread once the store is closed (its waits fail), then leave
        the groups in case it got through all the same."""
        from pagedcore.engine.distributed.group import destroy_groups

        thread.join()
        destroy_groups()

    def _worker_failed(self) -> bool:
        """A worker reported an error (after its hello it writes to its pipe only for that)
        or exited."""
        return (any(conn.poll() for conn in self._pool.conns.values())
                or any(not proc.is_alive() for proc in self._pool.procs.values()))

    def _fail_start(self, failures: dict[int, str],
                    joining: threading.Thread | None = None) -> NoReturn:
        """Stop everything and raise; with `joining` (`_join`'s thread), let it end first."""
        text = "; ".join(f"rank {r}: {t}" for r, t in sorted(failures.items()))
        message = f"a tensor-parallel worker failed to start: {text or 'no reason given'}"
        self._fail(message)
        if joining is not None:
            self._end_join(joining)
        raise TensorParallelError(message)
