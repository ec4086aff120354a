"""Two processes over gloo give the same greedy tokens (and logits) as one process, for a
full-attention model and a hybrid sliding-window + full model; a failing or killed worker stops
the engine with an error naming it, quickly."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed
from tp_helpers import (
    MAX_NEW,
    assert_same_outputs,
    make_llm,
    params,
    random_prompts,
    workload,
)

from pagedcore.engine.distributed import group
from pagedcore.engine.distributed.executor import TensorParallelExecutor
from pagedcore.engine.distributed.group import (
    FAULT_ENV,
    GRAPH_EMULATION_ENV,
    TIMEOUT_ENV,
    TensorParallelError,
    open_store,
)
from pagedcore.engine.distributed.pool import WorkerMonitor


def _executor(llm: object) -> TensorParallelExecutor:
    runner = getattr(llm, "runner")  # noqa: B009 - typed as the union in LLM
    assert isinstance(runner, TensorParallelExecutor)
    return runner


@pytest.mark.parametrize(("arch", "kv_bytes"), [("llama", 48 << 10), ("gemma2", 24 << 10)])
def test_two_ranks_match_one(arch: str, kv_bytes: int) -> None:
    prompts = workload()
    one = make_llm(arch, 1)
    expected = one.generate(prompts, params())
    two = make_llm(arch, 2, kv_bytes=kv_bytes)
    try:
        ex = _executor(two)
        # The status looks through the executor at rank 0's runner (CUDA graphs on a GPU).
        assert "need a CUDA device" in two.cudagraph_status()["reason"]
        got = two.generate(prompts, params())
        assert_same_outputs(expected, got)
        # Each rank caches its half of the KV heads; one block count for every rank.
        reports = ex.rank_reports
        assert [r.rank for r in reports] == [0, 1]
        assert all(r.num_kv_heads == (1,) * len(one.kv_cache_config.groups) for r in reports)
        assert all(r.num_heads == 2 for r in reports)
        assert len({(r.num_blocks, r.kv_cache_shape, r.backend_names) for r in reports}) == 1
        assert reports[0].num_blocks == two.kv_cache_config.num_blocks
        # The small budget forced preemption and the shared prefix hit the cache: the plan
        # carries whatever the scheduler decided.
        stats = two.stats()
        assert stats["preemptions"] > 0, stats
        assert stats["prefix_hit_tokens"] > 0, stats
        kv = two.kv_cache_manager
        assert kv.num_free_blocks == two.kv_cache_config.num_blocks - 1
        # Overlap scheduling: the workers resolve the placeholders from the ids rank 0
        # broadcasts; the outputs stay the same (preemptions and prefix hits included).
        assert two.set_async_scheduling(True) is True
        assert_same_outputs(expected, two.generate(prompts, params()))
        assert kv.num_free_blocks == two.kv_cache_config.num_blocks - 1
    finally:
        _executor(two).shutdown()
    assert all(not p.is_alive() for p in ex._pool.procs.values())


def test_two_ranks_with_an_fp8_cache() -> None:
    """An fp8 (e4m3) cache under tensor parallelism: every rank allocates it and calibrates
    its own KV heads' scales on the first prefill. Teacher-forced (growing prefixes of three
    prompts, one token each, later ones continuing a cached fp8 prefix), the full next-token
    distributions stay within tests/engine/test_fp8_kv_engine.py's bound of the float32 cache
    run in one process: mean KL <= 2e-3 nats (measured ~9e-4; one process with fp8 ~7e-4),
    the top token changing only where the float32 top two are within 0.1 nats."""
    import math

    from pagedcore import SamplingParams

    base = random_prompts([40, 23, 31], seed=3)
    prompts = [p[:n] for p in base for n in range(4, len(p) + 1, 3)]
    one_token = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=128)

    def dists(outs: list[object]) -> list[dict[int, float]]:
        return [dict(o.outputs[0].logprobs[0]) for o in outs]  # type: ignore[attr-defined]

    exact = dists(make_llm("llama", 1, max_logprobs=128).generate(prompts, one_token))
    two = make_llm("llama", 2, kv_cache_dtype="fp8", max_logprobs=128)
    try:
        reports = _executor(two).rank_reports
        assert [r.kv_cache_dtype for r in reports] == ["torch.float8_e4m3fn"] * 2, reports
        assert two.stats()["kv_scales"]["source"] == "pending (first prefill)"
        got = dists(two.generate(prompts, one_token))
        assert two.stats()["kv_scales"]["source"] == "first prefill"
        # Every rank calibrated its own heads (a worker left at scale 1.0 would still pass the
        # accuracy bound below on this small model; this catches it).
        statuses = _executor(two).kv_scale_statuses()
        assert [s["kv_scales"]["source"] for s in statuses] == ["first prefill"] * 2, statuses
        for s in statuses:
            for key in ("k_scale_range", "v_scale_range"):
                low, high = s["kv_scales"][key]
                assert 0 < low <= high < 0.5, statuses  # max|x| / 448 of this model's K/V
        assert two.stats()["prefix_hit_tokens"] > 0
    finally:
        _executor(two).shutdown()
    kls = []
    for x, y in zip(exact, got, strict=True):
        kls.append(sum(math.exp(v) * (v - y[t]) for t, v in x.items()))
        if max(x, key=x.__getitem__) != max(y, key=y.__getitem__):
            top2 = sorted(x.values(), reverse=True)[:2]
            assert top2[0] - top2[1] <= 0.1, top2
    assert len(kls) == 30 and sum(kls) / len(kls) <= 2e-3, sum(kls) / len(kls)


def test_failing_worker_stops_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "1:2")
    llm = make_llm("llama", 2)
    ex = _executor(llm)
    prompts = workload()
    with pytest.raises(TensorParallelError) as info:
        llm.generate(prompts, params())
    message = str(info.value)
    assert "rank 1 failed" in message and "injected fault at step 2" in message, message
    # Nothing the requests produced is lost: one final output per prompt, in order, with
    # the tokens of the steps that ran.
    outs = info.value.outputs
    assert len(outs) == len(prompts)
    assert all(o.finished and o.outputs[0].finish_reason == "error" for o in outs)
    assert [o.prompt_token_ids for o in outs] == [list(p) for p in prompts]
    assert any(o.outputs[0].token_ids for o in outs)
    assert ex._step == 3  # steps 0, 1 ran; step 2's plan went out, then rank 1 raised
    assert all(not p.is_alive() for p in ex._pool.procs.values())
    llm.add_request("late", random_prompts([5])[0], params())
    with pytest.raises(TensorParallelError, match="engine is stopped"):
        llm.step()


def test_killed_worker_is_named() -> None:
    llm = make_llm("gemma2", 2)
    ex = _executor(llm)
    llm.generate(random_prompts([6]), params())
    proc = ex._pool.procs[1]
    assert proc.pid is not None
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    with pytest.raises(TensorParallelError, match=r"rank 1 failed: process exited with code -9"):
        llm.generate(random_prompts([4]), params())


def test_worker_failing_during_setup_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "1:setup")
    with pytest.raises(TensorParallelError, match=r"rank 1 failed: .*injected fault during setup"):
        make_llm("llama", 2)


def test_worker_failing_before_the_rendezvous_is_named_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that fails after its hello but before the rendezvous is named at once, not
    after the collective timeout (120 s here), and nothing is left waiting: no worker, no
    rendezvous store, and a new tensor-parallel engine in this process works (a rank 0 left
    blocked in the rendezvous broke the next one)."""
    ports: list[int] = []

    def recording_open_store(**kwargs: Any) -> Any:
        store = open_store(**kwargs)
        ports.append(int(store.port))
        return store

    monkeypatch.setattr(group, "open_store", recording_open_store)
    monkeypatch.setenv(TIMEOUT_ENV, "120")
    monkeypatch.setenv(FAULT_ENV, "1:join")
    start = time.monotonic()
    named = r"rank 1.*: RuntimeError: injected fault before the rendezvous"
    with pytest.raises(TensorParallelError, match=named) as info:
        make_llm("llama", 2)
    assert time.monotonic() - start < 60
    left = [p.name for p in multiprocessing.active_children() if p.name.startswith("pagedcore-tp")]
    assert left == []
    # The store is closed by the failure itself, not by garbage collection: `info`'s traceback
    # keeps the half-built executor alive until here.
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", ports[0]), timeout=5).close()
    del info
    monkeypatch.delenv(FAULT_ENV)
    prompts = random_prompts([5, 11])
    expected = make_llm("llama", 1).generate(prompts, params())
    two = make_llm("llama", 2)
    try:
        assert_same_outputs(expected, two.generate(prompts, params()))
    finally:
        _executor(two).shutdown()


def _within(seconds: float, build: Callable[[], Any]) -> Any:
    """`build()` run in a thread, its result or its exception; fails the test when it has not
    returned within `seconds` (a rank 0 blocked in the rendezvous would hang the suite)."""
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(build())
        except BaseException as exc:  # handed to the test's thread
            result.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"still blocked after {seconds:g} s")
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def test_worker_killed_while_joining_the_groups_is_named_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker killed after its arrival mark, while rank 0 waits inside
    ``init_process_group`` (``1:init``) or inside the control group's ``new_group``
    (``1:group``, whose timeout used to be the control group's 30 days), is named with its
    exit code within seconds, not after the timeout (120 s here); nothing is left behind
    (no worker, no helper thread, no half-joined default group), so a new tensor-parallel
    engine in this process works. The order matters: a failed ``init_process_group``
    advanced torch's group counter, and the ``1:group`` join after it then waited for store
    keys its fresh worker never wrote."""
    monkeypatch.setenv(TIMEOUT_ENV, "120")
    threads = set(threading.enumerate())
    for point in ("init", "group"):
        monkeypatch.setenv(FAULT_ENV, f"1:{point}")
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"rank 1: process exited with code -9"):
            _within(40, lambda: make_llm("llama", 2))
        elapsed = time.monotonic() - start
        assert elapsed < 30, (point, elapsed)
        left = [p.name for p in multiprocessing.active_children()
                if p.name.startswith("pagedcore-tp")]
        assert left == [] and not torch.distributed.is_initialized(), (point, left)
        assert set(threading.enumerate()) <= threads, point
    monkeypatch.delenv(FAULT_ENV)
    two = make_llm("llama", 2)
    try:
        outs = two.generate(random_prompts([5, 11]), params())
        assert [len(o.outputs[0].token_ids) for o in outs] == [MAX_NEW, MAX_NEW]
    finally:
        _executor(two).shutdown()


def test_rank0_failure_stops_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = make_llm("llama", 2)
    ex = _executor(llm)
    runner = ex.runner
    assert runner is not None

    def broken(inputs: object) -> None:
        raise ValueError("rank 0 broke")

    monkeypatch.setattr(runner, "execute", broken)
    with pytest.raises(TensorParallelError, match="rank 0 failed: ValueError: rank 0 broke"):
        llm.generate(random_prompts([5]), params())
    # Rank 1 was waiting in the step's all-reduce; it must not be left hanging.
    assert all(not p.is_alive() for p in ex._pool.procs.values())


def test_rank0_setup_failure_stops_workers() -> None:
    # Rank 0 fails after the workers started (its max_model_len check runs once the model is
    # loaded) while they wait in the KV-budget all-reduce: the error propagates and no worker
    # is left behind (before, they kept the process from exiting).
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        make_llm("llama", 2, max_position_embeddings=64)
    left = [p.name for p in multiprocessing.active_children() if p.name.startswith("pagedcore-tp")]
    assert left == []


def test_monitor_reports_a_worker_that_exits() -> None:
    ctx = multiprocessing.get_context("fork")
    quick = ctx.Process(target=time.sleep, args=(0.2,))
    idle = ctx.Process(target=time.sleep, args=(60,))
    quick.start()
    idle.start()
    try:
        monitor = WorkerMonitor({3: quick, 4: idle})
        assert monitor.dead_rank is None
        quick.join()
        deadline = time.monotonic() + 5.0
        while monitor.dead_rank is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert monitor.dead_rank == 3
        monitor.stop()
    finally:
        idle.kill()
        idle.join()
    # Stopped before the worker exits (a graceful shutdown): nothing is reported.
    slow = ctx.Process(target=time.sleep, args=(0.2,))
    slow.start()
    quiet = WorkerMonitor({1: slow})
    quiet.stop()
    slow.join()
    time.sleep(0.1)
    assert quiet.dead_rank is None


_EMULATED_GRAPHS_SCRIPT = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[1])
from tp_helpers import assert_same_outputs, make_llm, params, workload
kw = dict(head_dim=64, block_size=16, backend="triton")
expected = make_llm("llama", 1, **kw).generate(workload(), params())
os.environ["PAGEDCORE_TP_GRAPH_EMULATION"] = "1"
two = make_llm("llama", 2, capture_sizes=[1, 2, 4, 8], **kw)
status = two.cudagraph_status()
assert status["sizes"] == [1, 2, 4, 8] and status["mixed_sizes"] == [16, 32], status
assert_same_outputs(expected, two.generate(workload(), params()))
two.runner.shutdown()
print("OK")
"""


def test_two_ranks_with_emulated_graphs_match_one() -> None:
    # Every rank "captures" decode and mixed-step graphs (EagerCapturer: the padded inputs and
    # buckets of a CUDA-graph engine, replayed eagerly) with the Triton kernels in the
    # interpreter: what the workers rebuild from the plans must match rank 0 bucket for bucket.
    pytest.importorskip("pagedcore_triton")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    env.pop(GRAPH_EMULATION_ENV, None)
    proc = subprocess.run([sys.executable, "-c", _EMULATED_GRAPHS_SCRIPT, here],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
