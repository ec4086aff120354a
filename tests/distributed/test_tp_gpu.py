"""NCCL on two GPUs: same greedy tokens and close logits as one GPU (float32, tiny models).

Needs two CUDA devices; skipped otherwise. Command for a 2-GPU machine:
``python -m pytest tests/distributed/test_tp_gpu.py -q``.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from tp_helpers import assert_same_outputs, make_llm, params, workload

from pagedcore.engine.distributed.group import FAULT_ENV, TensorParallelError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL)"),
]


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_nccl_two_gpus_match_one(arch: str) -> None:
    prompts = workload()
    # The reference backend: every backend claims head size 16 there, and float32 keeps ties rare.
    one = make_llm(arch, 1, device="cuda", backend="reference")
    expected = one.generate(prompts, params())
    two = make_llm(arch, 2, device="cuda", backend="reference")
    try:
        assert str(two.device) == "cuda:0"
        got = two.generate(prompts, params())
        assert_same_outputs(expected, got, tol=1e-3)
    finally:
        two.runner.shutdown()  # type: ignore[union-attr]


def _triton_llm(tp: int, **kw: Any) -> Any:
    # Head size 64 and block size 16 (Triton's smallest), float32: CUDA graphs for decode and mixed
    # steps on every rank, captured in lockstep.
    return make_llm("llama", tp, device="cuda", backend="triton", head_dim=64, block_size=16,
                    capture_sizes=[1, 2, 4, 8], **kw)


def test_nccl_cuda_graphs_match_one_gpu() -> None:
    prompts = workload()
    one = _triton_llm(1)
    assert one.cudagraph_status()["enabled"]
    expected = one.generate(prompts, params())
    two = _triton_llm(2)
    try:
        status = two.cudagraph_status()
        assert status["enabled"], status
        graphs = two.runner.runner.graphs  # type: ignore[union-attr]
        assert graphs is not None
        replayed: list[int] = []
        original = graphs.replay

        def counting(bucket: int) -> torch.Tensor:
            replayed.append(bucket)
            return original(bucket)

        graphs.replay = counting  # type: ignore[method-assign]
        got = two.generate(prompts, params())
        assert_same_outputs(expected, got, tol=1e-3)
        assert replayed, "no decode step replayed a graph on rank 0"
    finally:
        two.runner.shutdown()  # type: ignore[union-attr]


def test_worker_failing_inside_a_graph_replay_stops_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Rank 1 raises before step 12 (decode, replayed from a graph) while rank 0 is already in
    # the step's all-reduces: the monitor aborts NCCL and the step raises instead of hanging.
    monkeypatch.setenv(FAULT_ENV, "1:12")
    two = _triton_llm(2)
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank 1 failed: .*injected fault at step 12"):
        two.generate(workload(), params())
    assert time.monotonic() - t0 < 60
    with pytest.raises(TensorParallelError, match="stopped"):
        two.generate(workload(), params())
