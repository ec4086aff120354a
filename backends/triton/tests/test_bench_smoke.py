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
