"""The pagedcore conformance suite on the flash_attn backend.

* Where flash-attn and a suitable GPU are present: the full suite on the real kernels.
* Everywhere: the quick suite on the CPU through the adapter with the flash-attn TEST DOUBLE
  (`fa_varlen_double.VarlenDouble`) injected, so the suite's own batches (shuffled blocks, NaN
  in unused slots, -1 padding, GQA, window, ALiBi, soft-cap) exercise the marshalling.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
from fa_varlen_double import VarlenDouble
from pagedcore_flash_attn import FlashAttnBackend, flash_api

from pagedcore.conformance import run_suite


def test_full_suite_on_real_flash_attn() -> None:
    why = FlashAttnBackend.is_available()
    if why is not None:
        pytest.skip(f"flash_attn backend unavailable here: {why}")
    report = run_suite("flash_attn", quick=False)
    if report.skipped is not None:
        pytest.skip(f"flash_attn: {report.skipped}")
    assert report.passed, report.summary()


class _CpuDoubleBackend(FlashAttnBackend):
    """FlashAttnBackend declared for the CPU, for running the suite against the test double."""

    name: ClassVar[str] = "flash_attn_test_double"
    supported_devices: ClassVar[tuple[str, ...]] = ("cpu",)

    @classmethod
    def is_available(cls) -> str | None:
        return None


def test_quick_suite_through_the_test_double(monkeypatch: pytest.MonkeyPatch) -> None:
    double = VarlenDouble()
    monkeypatch.setattr(flash_api, "load_varlen_func", lambda: double)
    report = run_suite(_CpuDoubleBackend, quick=True, device="cpu")
    assert report.skipped is None, report.skipped
    assert report.passed, report.summary()
    assert double.calls, "the suite never reached flash_attn_varlen_func"
