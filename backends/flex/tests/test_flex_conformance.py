"""The pagedcore conformance suite on the flex backend, for real (eager flex on CPU).

The full suite fits CI on CPU (~25 s on 2 cores): every dtype, head size, GQA ratio, window,
ALiBi and soft-cap case the backend declares, over NaN-poisoned unused slots.
"""

from __future__ import annotations

import torch

from pagedcore.conformance import run_suite


def test_conformance_full() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report = run_suite("flex", device=device)
    assert report.skipped is None, report.skipped
    assert report.passed, report.summary()
    names = [r.name for r in report.results]
    for axis in ("float16", "bfloat16", "hs16", "hs256", "window", "alibi", "softcap"):
        assert any(axis in n for n in names), f"no conformance case covers {axis}"
