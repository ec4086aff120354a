"""`pagedcore bench kernels` drives this backend end to end (tiny shapes, timing stubbed)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pagedcore_triton import TritonAttentionBackend

from pagedcore.bench import kernels as bench


def _once(fn: Any, device: torch.device, **_: Any) -> float:
    fn()
    return 1.0


def test_bench_cases_agree_with_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "time_ms", _once)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tol = 2e-2 if device.type == "cuda" else 1e-4  # bf16 on a GPU, fp32 on the CPU
    rows = bench.bench_uniform("decode", 2, 40, [TritonAttentionBackend], device, 1.0)
    rows += bench.bench_uniform("prefill", 1, 24, [TritonAttentionBackend], device, 1.0)
    ours = [r for r in rows if r["impl"] == "triton"]
    assert len(ours) == 2
    assert all(r["rel_err_vs_sdpa"] < tol for r in ours), ours
    (mixed,) = bench.bench_mixed(2, 40, 16, 8, [TritonAttentionBackend], device)
    assert mixed["rel_err_mixed_vs_separate"] < tol


def test_capture_runner_matches_the_eager_plan() -> None:
    """The bench's CUDA-graph row uses the capture plan (here run eagerly, on any device)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kv = bench.PagedKV([70, 33, 5], dtype, device)
    query = torch.randn((3, bench.NUM_HEADS, bench.HEAD_SIZE), dtype=dtype, device=device)
    under = bench.BackendUnderTest(TritonAttentionBackend, kv)
    eager = under.runner(kv, [1, 1, 1], [0, 1, 2], query)().clone()
    graphed = under.capture_runner(kv, [0, 1, 2], query, max_seq_len=4096)
    assert graphed is not None
    out = graphed()
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert float((out.float() - eager.float()).norm() / eager.float().norm()) < tol
