"""Results of a conformance run: one `CaseResult` per case, gathered in a `ConformanceReport`."""

from __future__ import annotations

import json
from typing import Any

import attrs

__all__ = ["SCHEMA_VERSION", "CaseResult", "ConformanceReport"]

#: Version of the ``conformance --json`` record (docs/conformance.md); bumped on a breaking
#: change (a renamed or removed field), not when a field is added.
SCHEMA_VERSION = 1


@attrs.frozen(kw_only=True)
class CaseResult:
    """The outcome of one case.

    Attributes
    ----------
    name:
        The case name (``batch/dtype/hsD/bsB/hQkvK[/features]``).
    passed:
        True when the case ran and met its tolerance with no NaN in real rows; False when it
        failed *or* was skipped.
    max_rel_error:
        ``max|out - ref| / max|ref|`` over real output rows (None when it did not get that far).
    tolerance:
        The bound `max_rel_error` was held to.
    message:
        What went wrong (None when passed).
    skipped:
        Why the case did not run (None when it ran).
    seconds:
        Wall time of the case.
    """

    name: str
    passed: bool
    max_rel_error: float | None = None
    tolerance: float | None = None
    message: str | None = None
    skipped: str | None = None
    seconds: float = 0.0

    @classmethod
    def skip(cls, name: str, reason: str) -> CaseResult:
        return cls(name=name, passed=False, skipped=reason)

    @property
    def status(self) -> str:
        """``"PASS"``, ``"FAIL"`` or ``"SKIP"``."""
        if self.skipped is not None:
            return "SKIP"
        return "PASS" if self.passed else "FAIL"


@attrs.define(kw_only=True)
class ConformanceReport:
    """Everything one `run_suite` call found.

    Attributes
    ----------
    backend:
        The backend's name.
    device:
        Where it ran (None when the whole suite was skipped before choosing one).
    quick:
        Whether the reduced case list was used.
    results:
        One entry per case, in run order.
    skipped:
        Why the whole suite did not run (backend unavailable, no device), else None.
    """

    backend: str
    device: str | None
    quick: bool
    results: list[CaseResult] = attrs.field(factory=list)
    skipped: str | None = None

    @property
    def failures(self) -> list[CaseResult]:
        return [r for r in self.results if r.status == "FAIL"]

    @property
    def passed(self) -> bool:
        """True iff the suite ran, at least one case ran, and no case failed."""
        ran = [r for r in self.results if r.skipped is None]
        return self.skipped is None and bool(ran) and not self.failures

    def summary(self) -> str:
        """A plain-text table of every case, then a one-line verdict."""
        head = f"conformance: backend {self.backend!r}"
        if self.skipped is not None:
            return f"{head}: SKIPPED ({self.skipped})"
        head += f" on {self.device}{' (quick)' if self.quick else ''}"
        width = max([len(r.name) for r in self.results] + [4])
        lines = [head, f"{'case':<{width}}  status  rel.err   tol       note"]
        for r in self.results:
            err = "-" if r.max_rel_error is None else f"{r.max_rel_error:.2e}"
            tol = "-" if r.tolerance is None else f"{r.tolerance:.0e}"
            note = r.skipped or r.message or ""
            lines.append(f"{r.name:<{width}}  {r.status:<6}  {err:<8}  {tol:<8}  {note}")
        n_pass = sum(r.status == "PASS" for r in self.results)
        n_skip = sum(r.status == "SKIP" for r in self.results)
        verdict = "PASSED" if self.passed else "FAILED"
        lines.append(
            f"{verdict}: {n_pass} passed, {len(self.failures)} failed, {n_skip} skipped"
        )
        if self.failures:
            lines.append(
                f"rerun one case: pagedcore conformance {self.backend} -k "
                f"'{self.failures[0].name}'"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The JSON record documented in docs/conformance.md (``schema_version`` 1)."""
        return {
            "schema_version": SCHEMA_VERSION,
            "backend": self.backend,
            "device": self.device,
            "quick": self.quick,
            "passed": self.passed,
            "skipped": self.skipped,
            "results": [attrs.asdict(r) | {"status": r.status} for r in self.results],
        }

    def to_json(self) -> str:
        """The report as a JSON document (``results`` holds one object per case)."""
        return json.dumps(self.to_dict(), indent=2)
