"""The pagedcore conformance suite on the flashinfer backend.

* Where FlashInfer and a suitable GPU are present: the full suite on the real kernels.
* Everywhere: the quick suite on the CPU through the adapter with the FlashInfer TEST DOUBLE
  (`fi_double.FakeFlashInfer`) injected, in both mixed-step modes, so the suite's own batches
  (shuffled blocks, NaN in unused slots, -1 padding, GQA, window, soft-cap) exercise the
  planning arithmetic and the marshalling.
"""

from __future__ import annotations

from typing import ClassVar

import fi_double
import pytest
from pagedcore_flashinfer import FlashInferBackend, fi_api
from pagedcore_flashinfer.metadata import MIXED_MODE_ENV

from pagedcore.conformance import run_suite


def test_full_suite_on_real_flashinfer() -> None:
    why = FlashInferBackend.is_available()
    if why is not None:
        pytest.skip(f"flashinfer backend unavailable here: {why}")
    report = run_suite("flashinfer", quick=False)
    if report.skipped is not None:
        pytest.skip(f"flashinfer: {report.skipped}")
    assert report.passed, report.summary()


class _CpuDoubleBackend(FlashInferBackend):
    """FlashInferBackend declared for the CPU, for running the suite against the test double."""

    name: ClassVar[str] = "flashinfer_test_double"
    supported_devices: ClassVar[tuple[str, ...]] = ("cpu",)

    @classmethod
    def is_available(cls) -> str | None:
        return None


@pytest.mark.parametrize("mode", ["split", "prefill"])
def test_quick_suite_through_the_test_double(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    monkeypatch.setenv(MIXED_MODE_ENV, mode)
    monkeypatch.setattr(fi_api, "load_flashinfer", lambda: fi_double.FakeFlashInfer())
    fi_double.REGISTRY.clear()
    report = run_suite(_CpuDoubleBackend, quick=True, device="cpu")
    assert report.skipped is None, report.skipped
    assert report.passed, report.summary()
    # The graph-plan case (graph/decode/...) runs the use_cuda_graph decode wrappers in either
    # mode; the mixed-step mode decides which wrappers the eager steps use.
    graph = [w for w in fi_double.REGISTRY if getattr(w, "graph", False)]
    assert any(w.runs for w in graph)
    kinds = {w.kind for w in fi_double.REGISTRY if w.runs and w not in graph}
    assert kinds == ({"decode", "prefill"} if mode == "split" else {"prefill"}), kinds
