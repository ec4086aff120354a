"""The pagedcore conformance suite on this backend (Triton's interpreter on CPU without a GPU)."""

from __future__ import annotations

import torch

from pagedcore.conformance import run_suite


def test_conformance_quick() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report = run_suite("triton", quick=True, device=device)
    assert report.skipped is None, report.skipped
    assert report.passed, report.summary()
