"""Process groups, timeouts and the error a failed rank produces.

Two groups over the same ranks:

- the *compute* group (NCCL on CUDA, gloo on CPU) carries the all-reduces inside the forward;
  its timeout (`collective_timeout_s`) bounds how long a step may wait for a silent rank;
- the *control* group (always gloo, CPU objects) carries the step plans. Workers wait in it
  while the engine is idle, so its timeout is long (`CONTROL_TIMEOUT`); a dead rank 0 still
  wakes them at once (the socket closes).

The rendezvous runs over a `TCPStore` rank 0 hosts itself (`open_store`): a worker marks its
arrival there just before it joins, and rank 0 polls for the marks (`missing_ranks`) while it
watches the workers, joining only once all arrived. Joining first would leave rank 0 blocked in
``init_process_group`` until the timeout when a worker fails before it gets there. Rank 0 then
joins from a helper thread over a client connection of its own (`connect_store`), so closing
the server fails a join that a worker left by dying (`TensorParallelExecutor._join`). Both
groups are created with the startup's remaining time as their timeout and get their working
timeouts only once joined (`init_groups`).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import torch

__all__ = [
    "CONTROL_TIMEOUT",
    "FAULT_ENV",
    "GRAPH_EMULATION_ENV",
    "TIMEOUT_ENV",
    "Groups",
    "TensorParallelError",
    "check_uninitialized",
    "collective_timeout_s",
    "connect_store",
    "destroy_groups",
    "emulation_capturer",
    "init_groups",
    "min_over_ranks",
    "missing_ranks",
    "open_store",
    "rank_device",
]

#: Environment variable: seconds a collective may wait before the step fails (default 300).
TIMEOUT_ENV = "PAGEDCORE_TP_TIMEOUT_S"
#: Test hook, ``"RANK:STEP"``: that worker raises before executing that step.
FAULT_ENV = "PAGEDCORE_TP_FAULT"
#: Test hook, ``"1"``: every rank "captures" with `EagerCapturer` (graphs emulated on the CPU:
#: the padded graph inputs and buckets of a CUDA-graph engine, replayed eagerly).
GRAPH_EMULATION_ENV = "PAGEDCORE_TP_GRAPH_EMULATION"
CONTROL_TIMEOUT = datetime.timedelta(days=30)


class TensorParallelError(RuntimeError):
    """A rank of a tensor-parallel engine failed; the engine is stopped.

    Raised by a step, its ``outputs`` are the final outputs of every request the engine held
    (``finish_reason == "error"``, with the tokens generated before the failure); from
    `LLM.generate`, one per prompt of that call, in order. Empty when raised elsewhere
    (startup, shutdown)."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.outputs: list[Any] = []


def emulation_capturer() -> Any:
    """`EagerCapturer` when `GRAPH_EMULATION_ENV` is ``"1"``, else None (real CUDA graphs)."""
    if os.environ.get(GRAPH_EMULATION_ENV) != "1":
        return None
    from pagedcore.engine.runner.cuda_graph import EagerCapturer

    return EagerCapturer()


def collective_timeout_s() -> float:
    """`TIMEOUT_ENV` as seconds (default 300)."""
    raw = os.environ.get(TIMEOUT_ENV, "300")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be a positive number of seconds")
    return value


def _arrival_key(rank: int) -> str:
    return f"pagedcore/arrived/{rank}"


def open_store(*, rank: int, world_size: int, port: int, timeout_s: float) -> Any:
    """The rendezvous store on ``127.0.0.1:port``: rank 0 hosts it (``port=0``: a free port,
    read back as ``store.port``) and returns at once, without waiting for the workers; a
    worker connects to it (waiting up to `timeout_s` for the server)."""
    return _tcp_store(port, world_size, timeout_s, is_master=rank == 0)


def connect_store(*, port: int, world_size: int, timeout_s: float) -> Any:
    """A client connection to the rendezvous store on ``127.0.0.1:port``. Rank 0 joins over
    one rather than over the store it hosts: closing the server (dropping `open_store`'s
    object) then fails every store wait of a join in progress at once."""
    return _tcp_store(port, world_size, timeout_s, is_master=False)


def _tcp_store(port: int, world_size: int, timeout_s: float, *, is_master: bool) -> Any:
    import torch.distributed as dist

    # Public API; torch's stubs import it into torch.distributed without re-exporting it.
    return dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, world_size, is_master=is_master, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def missing_ranks(store: Any, world_size: int) -> list[int]:
    """The worker ranks that have not yet arrived at the rendezvous (does not wait)."""
    return [r for r in range(1, world_size) if not store.check([_arrival_key(r)])]


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank `rank`'s device: ``cuda:rank`` on CUDA, the CPU otherwise."""
    import torch

    if device.type == "cuda":
        if device.index not in (None, 0):
            raise ValueError(
                f"with tensor parallelism pass device='cuda' (rank r uses cuda:r), not {device}"
            )
        return torch.device("cuda", rank)
    return device


@attrs.frozen
class Groups:
    """This rank's view of the tensor-parallel process groups."""

    rank: int
    world_size: int
    compute: Any
    control: Any

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over the ranks, in place (compute group)."""
        import torch.distributed as dist

        dist.all_reduce(tensor, group=self.compute)


def check_uninitialized() -> None:
    """Raise unless this process is free to join a default process group."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialized in this process; a tensor-parallel LLM "
            "owns its process group: create it in a process without one, or shut the other "
            "one down (torch.distributed.destroy_process_group())"
        )


def init_groups(
    *, rank: int, world_size: int, store: Any, device: torch.device, timeout_s: float,
    join_timeout_s: float | None = None, stage: Callable[[str], None] | None = None,
) -> Groups:
    """Join the default process group over `store` (`open_store`, `connect_store`) and create
    both groups. A worker marks its arrival in the store first; rank 0 calls this once
    `missing_ranks` is empty.

    Joining waits at most `join_timeout_s` (default `timeout_s`) at each step; only then do
    the groups get their working timeouts (compute: `timeout_s`, control: `CONTROL_TIMEOUT`),
    so a peer lost mid-join is not waited for 30 days. When joining fails, the default group
    is left again, so the process can join another one later. `stage` (the workers' fault
    hook) is called with ``"arrived"`` before joining the default group and ``"joined"``
    before creating the control group."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    check_uninitialized()
    # torch names each new group after a process-wide counter, advanced even by a join that
    # failed, and reset only when a default group is destroyed: after a failed join the next
    # one would wait for keys no fresh worker writes (they start at 0). With no default
    # group there is no group, so 0 is right.
    world = getattr(distributed_c10d, "_world", None)
    if world is not None and getattr(world, "group_count", 0) != 0:
        world.group_count = 0
    # Keep gloo on the loopback interface (single host); respect an explicit choice.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if rank != 0:
        # Marked last, just before joining: a failure before it (set_device included) is
        # still reported to rank 0 at once.
        store.set(_arrival_key(rank), "1")
    if stage is not None:
        stage("arrived")
    joining = datetime.timedelta(seconds=timeout_s if join_timeout_s is None else join_timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=joining)
    try:
        compute = dist.group.WORLD
        if stage is not None:
            stage("joined")
        set_timeout = getattr(distributed_c10d, "_set_pg_timeout", None)
        # Without `_set_pg_timeout` (older torch) the control group keeps its working timeout
        # from the start, and a peer lost while it is created is waited for that long.
        control = dist.new_group(backend="gloo",
                                 timeout=joining if set_timeout else CONTROL_TIMEOUT)
        if set_timeout is not None:
            set_timeout(datetime.timedelta(seconds=timeout_s), compute)
            set_timeout(CONTROL_TIMEOUT, control)
    except BaseException:
        destroy_groups()
        raise
    return Groups(rank, world_size, compute, control)


def destroy_groups() -> None:
    """Leave the process groups (no-op when none). NCCL communicators are aborted, not
    destroyed: ``ncclCommDestroy`` can hang once collectives were captured in CUDA graphs
    (pytorch/pytorch#115388); the engine is done with them either way."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not dist.is_initialized():
        return
    abort = getattr(distributed_c10d, "_abort_process_group", None)
    if dist.get_backend() == "nccl" and abort is not None:
        abort()
    else:
        dist.destroy_process_group()


def min_over_ranks(groups: Groups, value: int, device: torch.device) -> int:
    """The smallest `value` any rank passed (a collective: every rank must call it)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=groups.compute)
    return int(t.item())
