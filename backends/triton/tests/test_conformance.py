"""The pagedcore conformance suite on this backend (Triton's interpreter on CPU without a GPU)."""

from __future__ import annotations

import torch

from pagedcore.conformance import run_suite


def test_conformance_quick() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report = run_suite("triton", quick=True, device=device)
    assert report.skipped is None, report.skipped
    assert report.passed, report.summary()


def test_conformance_needles() -> None:
    """The full suite's `needles` batch (2,100-token contexts with needle keys on block, tile
    and split edges): the split-KV decode must read every edge position right."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report = run_suite("triton", device=device, case_filter="needles/")
    assert report.skipped is None, report.skipped
    assert [r.name.split("/")[0] for r in report.results] == ["needles"]
    assert report.passed, report.summary()
