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
    and split edges), in the model dtype and in each fp8 cache dtype: the split-KV decode must
    read every edge position right."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report = run_suite("triton", device=device, case_filter="needles/")
    assert report.skipped is None, report.skipped
    names = [r.name for r in report.results]
    # The model-dtype batch, and one per declared fp8 cache dtype (the same edges, dequantized).
    assert {n.split("/")[0] for n in names} == {"needles"}
    base = "float16" if device == "cuda" else "float32"  # the suite's base dtype there
    assert f"needles/{base}/hs128/bs16/h8kv2" in names and len(names) == 3, names
    assert report.passed, report.summary()
