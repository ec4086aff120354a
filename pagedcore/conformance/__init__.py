"""The per-backend conformance suite: any backend against the reference, on what it declares.

``run_suite(backend, quick=..., device=...)`` returns a `ConformanceReport`; the same cases run
as ``pagedcore conformance NAME`` and as pytest tests (``pytest --pagedcore-backend NAME``, or
the ``pagedcore_conformance`` fixture). Case lists live in `cases`, execution in `harness`
(imports torch), the per-dtype tolerances in ``cases.TOLERANCES``; the CUDA-graph planning
cases (``graph/...``, for backends that declare graph support) in `graphs`.
"""

from pagedcore.conformance.cases import TOLERANCES, BatchSpec, CaseSpec
from pagedcore.conformance.report import CaseResult, ConformanceReport
from pagedcore.conformance.runner import list_cases, run_suite

__all__ = [
    "TOLERANCES",
    "BatchSpec",
    "CaseResult",
    "CaseSpec",
    "ConformanceReport",
    "assert_conformance",
    "list_cases",
    "run_suite",
]


def assert_conformance(
    backend: object, *, quick: bool = True, device: str | None = None
) -> ConformanceReport:
    """Run the suite and raise AssertionError with the summary table unless it passed.

    An unavailable backend raises too; inside pytest use the ``pagedcore_conformance``
    fixture, which skips instead.
    """
    report = run_suite(backend, quick=quick, device=device)  # type: ignore[arg-type]
    if not report.passed:
        raise AssertionError(report.summary())
    return report
