"""The loop of a tensor-parallel rank > 0, run in a spawned process.

Setup mirrors rank 0 collective for collective: connect to rank 0's rendezvous store and join
the groups, load the model and keep this rank's shard, agree on the KV-cache budget (minimum
over ranks), receive the `WorkerSetup` (the KV-cache config rank 0's scheduler plans with),
build a `ModelRunner` (the selector runs here too), report back, and capture the same CUDA
graphs as rank 0 when asked. Then each step: receive a `StepPlan`, rebuild the inputs, run the
forward (its all-reduces meet rank 0's); ``None`` ends the loop.

Any exception is sent to rank 0 over the worker's pipe (rank, type, message, traceback) and
the process exits, which closes its sockets: rank 0's pending collective fails at once and
rank 0 raises `TensorParallelError` naming this rank.
"""

from __future__ import annotations

import os
import signal
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from pagedcore.engine.distributed.group import FAULT_ENV, emulation_capturer

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    import torch

    from pagedcore.kv_cache.spec import KVCacheConfig

__all__ = ["KVScaleQuery", "RankReport", "WorkerArgs", "WorkerSetup", "graph_status",
           "parse_fault", "worker_main"]

_MAX_REPORT_CHARS = 8000


@attrs.frozen(kw_only=True)
class WorkerArgs:
    """What a worker process is started with (pickled by the spawn start method)."""

    rank: int
    world_size: int
    port: int  # rank 0's rendezvous store, on 127.0.0.1
    model: Any  # a str or a transformers PretrainedConfig
    dtype: torch.dtype
    device_type: str
    seed: int
    num_threads: int
    timeout_s: float
    kv_cache_memory_bytes: int | None
    gpu_memory_utilization: float
    trust_remote_code: bool = False


@attrs.frozen(kw_only=True)
class WorkerSetup:
    """Broadcast by rank 0 once its scheduler's KV-cache config is fixed."""

    kv_cache_config: KVCacheConfig
    backend: str | None
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    num_heads: int
    cudagraphs: bool = False
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    #: ``"auto"`` or the fp8 name of the KV cache (the config's specs carry its dtype).
    kv_cache_dtype: str = "auto"
    #: Rank 0's checkpoint scales per layer index ``(k_scale, v_scale)``, or None: each rank
    #: then calibrates its own layers' scales on the first prefill, over its own KV heads.
    kv_scales: dict[int, tuple[float, float]] | None = None


@attrs.frozen
class KVScaleQuery:
    """Broadcast by rank 0 instead of a step plan, between steps: every rank answers with its
    `ModelRunner.kv_scale_status()` (gathered on rank 0)."""


@attrs.frozen(kw_only=True)
class RankReport:
    """What each rank built, gathered on rank 0 (and checked to agree)."""

    rank: int
    backend_names: tuple[str, ...]
    num_blocks: int
    num_kv_heads: tuple[int, ...]
    num_heads: int
    kv_cache_shape: tuple[int, ...]
    #: The KV cache's torch dtype (``"torch.float8_e4m3fn"`` for an fp8 cache).
    kv_cache_dtype: str = ""


def rank_report(rank: int, runner: Any, num_heads: int) -> RankReport:
    """`RankReport` of a built `ModelRunner`."""
    cfg = runner.kv_cache_config
    first = next(iter(runner.kv_caches.values()))
    return RankReport(
        rank=rank,
        backend_names=tuple(runner.backend_names),
        num_blocks=int(cfg.num_blocks),
        num_kv_heads=tuple(int(g.spec.num_kv_heads) for g in cfg.groups),
        num_heads=num_heads,
        kv_cache_shape=tuple(first.shape),
        kv_cache_dtype=str(first.dtype),
    )


def graph_status(runner: Any) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """The CUDA graphs a `ModelRunner` captured: (decode batch sizes, mixed token buckets),
    each None when that kind runs eagerly; every rank must report the same."""
    decode = None if runner.graphs is None else tuple(sorted(runner.graphs.sizes))
    mixed = None if runner.mixed_graphs is None else tuple(sorted(runner.mixed_graphs.sizes))
    return decode, mixed


#: The "step" of a fault injected during setup (after loading, before the first collective).
SETUP_STEP = -1
#: The "step" of a fault injected before the worker reaches the rendezvous (after its hello).
JOIN_STEP = -2
#: The "step" of a kill injected after the worker's arrival mark, before it joins the default
#: group (rank 0 is then inside ``init_process_group``).
INIT_STEP = -3
#: The "step" of a kill injected after the worker joined the default group, before it creates
#: the control group (rank 0 is then inside ``new_group``).
GROUP_STEP = -4
#: Startup stages of `init_groups`' ``stage`` callback, by the fault "step" that kills there.
_KILLED_AT = {INIT_STEP: "arrived", GROUP_STEP: "joined"}


def parse_fault(raw: str | None) -> tuple[int, int] | None:
    """`FAULT_ENV` (``"RANK:STEP"``, STEP an integer, ``setup``, ``join``, ``init`` or
    ``group``) as ``(rank, step)``, the names being `SETUP_STEP`, `JOIN_STEP`, `INIT_STEP` and
    `GROUP_STEP`; None when unset. ``init`` and ``group`` kill the worker (SIGKILL, as the OOM
    killer would) instead of raising: it reports nothing."""
    if not raw:
        return None
    try:
        rank_text, step_text = raw.split(":")
        named = {"setup": SETUP_STEP, "join": JOIN_STEP, "init": INIT_STEP,
                 "group": GROUP_STEP}
        step = named[step_text] if step_text in named else int(step_text)
        return int(rank_text), step
    except ValueError:
        raise ValueError(
            f"{FAULT_ENV}={raw!r} must look like 'RANK:STEP' or 'RANK:NAME' (NAME one of "
            "setup, join, init, group), e.g. '1:3'"
        ) from None


def _killer(fault: tuple[int, int] | None, rank: int) -> Callable[[str], None] | None:
    """`init_groups`' stage callback that kills this process at the stage `fault` names."""
    if fault is None or fault[0] != rank or fault[1] not in _KILLED_AT:
        return None
    doomed = _KILLED_AT[fault[1]]

    def kill(stage: str) -> None:
        if stage == doomed:
            os.kill(os.getpid(), signal.SIGKILL)

    return kill


def worker_main(args: WorkerArgs, conn: Connection) -> None:
    """Entry point of a worker process: run, and on any error report it and exit(1)."""
    try:
        _run(args, conn)
    except BaseException as exc:
        text = "".join(traceback.format_exception(exc))[-_MAX_REPORT_CHARS:]
        try:
            conn.send(("error", args.rank, f"{type(exc).__name__}: {exc}", text))
            conn.close()
        finally:
            # Skip interpreter teardown: destroying a process group mid-collective can block.
            os._exit(1)


def _run(args: WorkerArgs, conn: Connection) -> None:
    import torch
    import torch.distributed as dist

    from pagedcore.engine.distributed.group import (
        destroy_groups,
        init_groups,
        min_over_ranks,
        open_store,
        rank_device,
    )
    from pagedcore.engine.distributed.plan import StepPlan, scheduled_from_plan
    from pagedcore.engine.distributed.sharding import shard_model
    from pagedcore.engine.models.loading import load_model
    from pagedcore.engine.resources import default_kv_cache_bytes
    from pagedcore.engine.runner.model_runner import ModelRunner
    from pagedcore.engine.runner.overlap import resolve_placeholders

    torch.set_num_threads(args.num_threads)
    fault = parse_fault(os.environ.get(FAULT_ENV))
    device = rank_device(torch.device(args.device_type), args.rank)
    conn.send(("hello", args.rank))
    if fault == (args.rank, JOIN_STEP):
        raise RuntimeError(f"injected fault before the rendezvous ({FAULT_ENV})")
    store = open_store(rank=args.rank, world_size=args.world_size, port=args.port,
                       timeout_s=args.timeout_s)
    groups = init_groups(rank=args.rank, world_size=args.world_size, store=store,
                         device=device, timeout_s=args.timeout_s,
                         stage=_killer(fault, args.rank))
    model = load_model(args.model, dtype=args.dtype, device=device, seed=args.seed,
                       trust_remote_code=args.trust_remote_code).model
    shard_model(model, rank=args.rank, world_size=args.world_size, all_reduce=groups.all_reduce)
    if fault == (args.rank, SETUP_STEP):
        raise RuntimeError(f"injected fault during setup ({FAULT_ENV})")
    budget = args.kv_cache_memory_bytes
    if budget is None:
        budget = default_kv_cache_bytes(device, model.config, args.gpu_memory_utilization)
    min_over_ranks(groups, budget, device)

    received: list[Any] = [None]
    dist.broadcast_object_list(received, src=0, group=groups.control)
    setup: WorkerSetup = received[0]
    runner = ModelRunner(
        model,
        kv_cache_config=setup.kv_cache_config,
        device=device,
        dtype=args.dtype,
        backend=setup.backend,
        max_num_seqs=setup.max_num_seqs,
        max_num_batched_tokens=setup.max_num_batched_tokens,
        max_model_len=setup.max_model_len,
        num_heads=setup.num_heads,
        kv_cache_dtype=setup.kv_cache_dtype,
        kv_scales=setup.kv_scales,
    )
    dist.gather_object(rank_report(args.rank, runner, setup.num_heads), None, dst=0,
                       group=groups.control)
    if setup.cudagraphs:
        # Same buckets, same order as rank 0: the warm-up forwards' all-reduces meet.
        runner.enable_cudagraphs(sizes=setup.cudagraph_capture_sizes, fallback=False,
                                 capturer=emulation_capturer())
        dist.gather_object(graph_status(runner), None, dst=0, group=groups.control)
    while True:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0, group=groups.control)
        plan: StepPlan | KVScaleQuery | None = message[0]
        if plan is None:
            break
        if isinstance(plan, KVScaleQuery):
            dist.gather_object(runner.kv_scale_status(), None, dst=0, group=groups.control)
            continue
        if fault == (args.rank, plan.step):
            raise RuntimeError(f"injected fault at step {plan.step} ({FAULT_ENV})")
        scheduled, block_ids = scheduled_from_plan(plan)
        sampled = None
        if plan.num_sampled_ids:  # overlap scheduling: rank 0's last sampled ids
            sampled = torch.empty(plan.num_sampled_ids, dtype=torch.int64, device=device)
            dist.broadcast(sampled, src=0, group=groups.compute)
        inputs = runner.prepare(scheduled, block_ids, decode_graph=plan.decode_graph)
        if sampled is not None:
            resolve_placeholders(inputs.input_ids, sampled)
        runner.execute(inputs)
    runner.release_graphs()  # before the communicator they captured goes
    destroy_groups()
    conn.send(("bye", args.rank))
