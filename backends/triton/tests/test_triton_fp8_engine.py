"""The engine over the triton backend's fp8 cache on a GPU (CUDA graphs for decode and mixed
steps, chunked prefill): its full next-token distributions against the same engine with a
16-bit cache and against the reference backend's fp8 engine (`tools/fp8_engine_check.py`).

The bound is the oracle's own: the reference backend on the same fp8 arithmetic loses
KL(16-bit || fp8) = k_ref, the triton engine may lose no more than 1.5 x k_ref + 1e-4, and
against the oracle's fp8 run its KL must be an order below k_ref. A dropped scale, a misread
cache or a stale graph moves either by orders of magnitude. Measured on an H100 at 83e6a68
(docs/benchmarks/h100_s20/): k_ref 0.070 (e4m3) / 0.180 (e5m2), triton against the oracle's
fp8 run 1.8e-4 / 1.0e-3. GPU only: Triton's interpreter would take minutes for these prompts,
and the CPU tests cover the fp8 kernels through the conformance suite.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))


pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA graphs over real kernels")


@pytest.fixture(scope="module")
def ref16() -> dict[str, Any]:
    """The triton engine over a 16-bit cache (run once for both fp8 formats)."""
    import fp8_engine_check as check

    return check.run("auto", "triton")


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_engine_matches_the_oracle(kv: str, ref16: dict[str, Any]) -> None:
    import fp8_engine_check as check

    tri8, ref8 = check.run(kv, "triton"), check.run(kv, "reference")
    k_ref = check.divergence(ref16, ref8)["mean_kl"]
    k_tri = check.divergence(ref16, tri8)["mean_kl"]
    assert k_tri <= 1.5 * k_ref + 1e-4, (k_tri, k_ref)
    same = check.divergence(ref8, tri8)
    assert same["mean_kl"] <= 0.1 * k_ref + 1e-4, (same, k_ref)
    assert same["positions"] >= 96, same  # the two fp8 engines agree along most of the 192
    assert tri8["step_paths"].get("decode graph", 0) > 0, tri8["step_paths"]
    assert tri8["kv_scales"]["source"] == "first prefill"
