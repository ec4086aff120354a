"""NCCL on two GPUs: same greedy tokens and close logits as one GPU (float32, tiny models).

Needs two CUDA devices; skipped otherwise. Command for a 2-GPU machine:
``python -m pytest tests/distributed/test_tp_gpu.py -q``.
"""

from __future__ import annotations

import pytest
import torch
from tp_helpers import assert_same_outputs, make_llm, params, workload

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
