"""The compiled kernels against the reference on a GPU (skipped with a reason elsewhere).

A short slice of bench/check_gpu.py's sweep; the full sweep, the conformance suite and the
sanitizers run through bench/gpu_run.sh.
"""

from __future__ import annotations

import pytest
import torch
from check_gpu import TOL, run_case, run_graph_case
from pagedcore_cuda_paged import CudaPagedBackend
from pagedcore_cuda_paged.plan import DecodePass

WHY = CudaPagedBackend.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(WHY is not None, reason=f"cuda_paged: {WHY}")]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("force", [DecodePass.ONE_PASS, DecodePass.PARTITIONED])
@pytest.mark.parametrize("group_heads", [True, False])
def test_mixed_step_matches_reference(dtype: torch.dtype, force: DecodePass,
                                      group_heads: bool) -> None:
    err = run_case(dtype, 128, 16, 2, 4, window=37, alibi=True, cap=5.0, force=force, seed=7,
                   group_heads=group_heads)
    assert err <= TOL[dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cuda_graph_replay_after_in_place_rewrites(dtype: torch.dtype) -> None:
    err = run_graph_case(dtype, 128, 16, window=None)
    assert err <= TOL[dtype], f"relative error {err:.2e}"
